"""The agent demo's calculator task written with the agent frameworks people use, each as its own
docs write an agent, pointed at the rollout's endpoint (``rollout.agent=demos.agent_frameworks:<name>``):

- ``openai_agents``: the OpenAI Agents SDK (``openai-agents``), an ``Agent`` with one function tool,
  run by its ``Runner`` over the Responses API;
- ``anthropic_messages``: Anthropic's SDK, a ``tool_use`` loop over the Messages API;
- ``langgraph``: LangGraph's prebuilt ReAct agent on ``langchain-openai``'s ``ChatOpenAI`` (chat
  completions);
- ``smolagents``: a smolagents ``ToolCallingAgent`` on its ``OpenAIServerModel`` (chat completions).

Each is ``run(client, row) -> reward``: ``client`` is the episode's OpenAI client, whose
``base_url`` and ``api_key`` (the episode's key) each framework is given as it takes them. Every
program makes at most four model calls, as ``demos.agent.openai_agent`` does, and is rewarded with
the exact answer of its last reply. The frameworks are the ``agents`` extra
(``pip install -e '.[agents]'``).
"""

from __future__ import annotations

from demos.agent import OPENAI_AGENT, add, calculator, exact_answer

# tether demo --agent --framework <name>: each framework's program
FRAMEWORKS = {"openai-agents": "openai_agents", "anthropic": "anthropic_messages", "langgraph": "langgraph",
              "smolagents": "smolagents"}
MAX_CALLS = 4  # model calls an episode makes at most, as demos.agent.openai_agent
MAX_TOKENS = 20  # each reply's bound, as demos.agent.openai_agent


def overrides(framework: str) -> list[str]:
    """The agent demo's episodes as the task written with ``framework`` (a key of FRAMEWORKS), as
    ``tether demo --agent --openai``'s are demos.agent.openai_agent's."""
    return [*(override for override in OPENAI_AGENT if not override.startswith(("rollout.agent=", "run_dir="))),
            f"rollout.agent=demos.agent_frameworks:{FRAMEWORKS[framework]}", f"run_dir=runs/demo-agent-{framework}"]


def exact(text: str | None, row: dict) -> float:
    """The exact answer of the last reply's ``text``."""
    return exact_answer(None, text or "", row)


def tool_error(error: Exception) -> str:
    """A tool's failure as the program tells the policy of it (demos.agent.openai_agent's words)."""
    return f"error: calculator raised {type(error).__name__}: {error}"


async def openai_agents(client, row: dict) -> float:
    """The OpenAI Agents SDK: an Agent with the calculator as a function tool, its model the
    Responses API at the endpoint, run for at most MAX_CALLS turns."""
    from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # traces go to OpenAI's platform otherwise
    tools = [function_tool(calculator, failure_error_function=lambda _, error: tool_error(error))]
    agent = Agent(name="calculator", tools=tools, model=OpenAIResponsesModel("policy", client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS))
    try:
        result = await Runner.run(agent, row["prompt"], max_turns=MAX_CALLS)
    except (MaxTurnsExceeded, ModelBehaviorError):  # the SDK raises for a reply cut at max_tokens ("incomplete")
        return 0.0  # too: no answer, as the chat program's cut reply gives none
    return exact(result.final_output, row)


async def anthropic_messages(client, row: dict) -> float:
    """Anthropic's SDK: messages.create with the calculator as a tool, each tool_use answered with
    its tool_result, at most MAX_CALLS calls. Its base URL is the endpoint's root (the SDK adds
    /v1), its key the episode's (sent as x-api-key)."""
    import anthropic

    claude_client = anthropic.AsyncAnthropic(base_url=str(client.base_url).removesuffix("/").removesuffix("/v1"),
                                             api_key=client.api_key, max_retries=0)
    tool = {"name": "calculator", "description": "Add two whole numbers.", "input_schema": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
    messages, text = [{"role": "user", "content": row["prompt"]}], ""
    try:
        for _ in range(MAX_CALLS):
            reply = await claude_client.messages.create(model="policy", max_tokens=MAX_TOKENS, tools=[tool],
                                                        messages=messages)
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                              for block in reply.content]})
            text = "".join(block.text for block in reply.content if block.type == "text")
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                break
            results = []
            for call in calls:
                try:
                    content = calculator(**call.input)
                except Exception as error:
                    content = tool_error(error)
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": content})
            messages.append({"role": "user", "content": results})
            text = ""
    finally:
        await claude_client.close()
    return exact(text, row)


async def langgraph(client, row: dict) -> float:
    """LangGraph's prebuilt ReAct agent on langchain-openai's ChatOpenAI, the calculator a
    LangChain tool; MAX_CALLS model calls are a recursion limit of twice as many steps."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import ToolNode, create_react_agent

    # the episode's own client: ChatOpenAI otherwise keeps one async HTTP client per base URL for the
    # whole process, bound to the event loop of the episode that made it, and each program thread
    # runs a loop of its own ("bound to a different event loop" in the next thread's episodes)
    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key,
                       root_async_client=client, async_client=client.chat.completions, max_tokens=MAX_TOKENS,
                       max_retries=0)
    tools = ToolNode([tool(calculator)], handle_tool_errors=tool_error)
    agent = create_react_agent(model, tools)
    try:
        state = await agent.ainvoke({"messages": [{"role": "user", "content": row["prompt"]}]},
                                    {"recursion_limit": 2 * MAX_CALLS})
    except GraphRecursionError:
        return 0.0
    return exact(state["messages"][-1].content, row)


def smolagents(client, row: dict) -> float:
    """A smolagents ToolCallingAgent on OpenAIServerModel (a plain function: smolagents' agents are
    synchronous), the calculator a smolagents tool, at most MAX_CALLS steps."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.models import REMOVE_PARAMETER

    @tool
    def adder(expression: str) -> str:
        """Add two whole numbers.

        Args:
            expression: two numbers and a plus sign between them, such as "374 + 589"
        """
        return add(expression)

    # its agents ask for tool_choice "required" and stop strings by default: constraints on the
    # policy's turn the endpoint refuses (a run's turns are sampled as the run samples and end where
    # the policy ends them); the model's own kwargs win over its agent's
    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url), api_key=client.api_key,
                              max_tokens=MAX_TOKENS, tool_choice="auto", stop=REMOVE_PARAMETER)
    agent = ToolCallingAgent(tools=[adder], model=model, max_steps=MAX_CALLS, verbosity_level=0)
    return exact(str(agent.run(row["prompt"])), row)
