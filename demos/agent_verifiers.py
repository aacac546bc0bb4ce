"""The agent demo's task (demos/agent.py) as a verifiers environment (``rollout.environment:
verifiers:demos.agent_verifiers``), written with verifiers' own classes as its users write one
(``load_environment``): a ``ToolEnv`` with the calculator, or with ``tools=False`` a
``SingleTurnEnv``; a ``Rubric`` of the exact answer either way. tests/test_agent_demo.py checks
both against the native episodes, token for token; bench/agent.py measures what an episode costs."""

import asyncio

import verifiers as vf
from datasets import Dataset

from demos import agent
from demos.agent import exact_answer


async def calculator(expression: str) -> str:
    """Add two whole numbers.

    Args:
        expression: two numbers and a plus sign between them, such as "374 + 589"
    """
    # the demo's tool, its latency awaited: verifiers runs its episodes in one event loop
    return await asyncio.to_thread(agent.calculator, expression)


def load_environment(tools: bool = True) -> vf.Environment:
    parser = vf.Parser()

    async def exact(completion, answer, **_) -> float:
        return exact_answer(None, parser.parse_answer(completion) or "", {"answer": answer})

    dataset = Dataset.from_list([{"question": "add 1 2 3 + 4 5 6 :", "answer": "579"},
                                 {"question": "add 9 0 0 + 1 0 0 :", "answer": "1000"}])
    rubric = vf.Rubric(funcs=[exact], parser=parser)
    if tools:
        return vf.ToolEnv(dataset=dataset, tools=[calculator], max_turns=4, parser=parser, rubric=rubric,
                          error_formatter=lambda error: f"error: calculator raised {type(error).__name__}: {error}")
    return vf.SingleTurnEnv(dataset=dataset, parser=parser, rubric=rubric)
