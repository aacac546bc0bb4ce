"""An agent program in a process of its own (rollout.agent_command): the OpenAI client configures
itself from OPENAI_BASE_URL and OPENAI_API_KEY (Anthropic's, where the row says ``anthropic``, from
ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY), the row comes on stdin, the reward goes last on stdout.
``fail`` in the row: it exits 3 with a message on stderr before it calls."""

import json
import sys

from openai import OpenAI

row = json.loads(sys.stdin.readline())
if row.get("fail"):
    print("no model to call today", file=sys.stderr)
    sys.exit(3)
if row.get("anthropic"):
    from anthropic import Anthropic

    message = Anthropic(max_retries=0).messages.create(model="policy", max_tokens=16,
                                                       messages=[{"role": "user", "content": row["prompt"]}])
    said = "".join(block.text for block in message.content if block.type == "text")
else:
    client = OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    said = reply.choices[0].message.content
print("a line of its own log")
print(json.dumps({"reward": 1.0 if said == "42" else 0.0}))
