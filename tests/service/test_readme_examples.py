"""Every example of the README's "Using the API" section runs against a real server (``python -m service`` on
127.0.0.1, the tests' tiny models under the default models' names) and answers as the README says: each curl
command a 2xx, the structured-output examples complete outputs that parse, the OpenAI client example its choices.
The "Chat" section's examples run against a tiny random instruct model with a ChatML template
(tests/deploy/chat_model.py) served under the README's name for one.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest

from service.local_server import ROOT, running_server
from tests.deploy.chat_model import chat_model_directory
from tests.service.conftest import ADAPTERS, CLS, LM, MT
from tests.service.server import sse_data

README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTION = README[README.index("## Using the API"):README.index("### Serve a Hugging Face model")]
NAMES = {"translation": MT, "langid": CLS, "code": LM}  # the README's model names -> the tests' models
CHAT_SECTION = README[README.index("### Chat"):README.index("## Training on your own data")]
CHAT_MODEL = "SmolLM2-135M-Instruct"  # the README's instruct model


def commands(section: str = SECTION) -> list[str]:
    """The shell commands of a section's bash blocks (continued lines joined, comments dropped)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        pending = ""
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            pending = f"{pending} {line.strip()}" if pending else line.split("   #")[0].strip()
            if pending.count("'") % 2 == 0:  # a quoted body may go on over several lines
                if pending and not pending.startswith("#"):
                    found.append(pending)
                pending = ""
    return found


@pytest.fixture(scope="module")
def readme_server(models_dir, adapters_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    for name, model in NAMES.items():
        (root / "models").mkdir(exist_ok=True)
        (root / "models" / name).symlink_to(models_dir / model)
    (root / "adapters" / "code").mkdir(parents=True)
    adapter = adapters_dir / LM / ADAPTERS[LM]
    shutil.copytree(adapter, root / "adapters" / "code" / "tests")  # adapters are held to their directory
    with running_server(root / "models", root / "adapters", TSERVE_ADAPTERS=str(root / "adapters")) as server:
        yield server, root, adapter


def run(command: str, url: str, cwd) -> subprocess.CompletedProcess:
    setup = f"H='Content-Type: application/json'; U={url}; "
    return subprocess.run(["bash", "-c", setup + command], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_curl_example_answers_as_the_readme_says(readme_server):
    server, root, adapter = readme_server
    ran = 0
    for command in commands():
        if command.startswith("H="):
            continue
        command = command.replace("path/to/adapter", str(adapter))
        if command.startswith("curl") and "|" not in command:
            command = command.replace("curl", "curl -sS -w '\\n%{http_code}'", 1)
            done = run(command, server.url, root)
            body, _, status = done.stdout.rpartition("\n")
            assert done.returncode == 0 and status in ("200", "204"), (command, done.stdout[-800:], done.stderr)
            if '"constraint"' in command:  # structured output: complete, and valid under its constraint
                (output,) = json.loads(body)["outputs"]
                assert output["constraint_satisfied"] is True, (command, output)
                constraint = json.loads(re.search(r"-d '(.*)'", command).group(1))["constraint"]
                if "json_schema" in constraint:
                    jsonschema.validate(json.loads(output["text"]), constraint["json_schema"])
                else:
                    assert output["text"] in constraint["choice"]
        else:
            done = run(command, server.url, root)
            assert done.returncode == 0, (command, done.stderr)
        ran += 1
    assert ran >= 20  # every example of the section (21 on 2026-11-27), not a parse that found nothing


def test_the_openai_client_example_runs(readme_server):
    server, root, _ = readme_server
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if "OpenAI(" in b)
    snippet = snippet.replace("http://127.0.0.1:8000", server.url) + "\nprint(len(vectors), len(vectors[0]))\n"
    done = subprocess.run([sys.executable, "-c", snippet], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    choices, sizes = done.stdout.strip().splitlines()
    assert len(ast.literal_eval(choices)) == 2 and sizes.split()[0] == "2"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme-chat")
    chat_model_directory(root / "models" / CHAT_MODEL)
    with running_server(root / "models", TSERVE_WARMUP="false") as server:
        yield server, root


def test_every_chat_curl_example_answers_as_the_readme_says(chat_server):
    server, root = chat_server
    found = commands(CHAT_SECTION)
    assert len(found) == 2, found  # plain and streamed
    for command in found:
        done = run(command.replace("curl", "curl -sS -w '\\n%{http_code}'", 1), server.url, root)
        body, _, status = done.stdout.rpartition("\n")
        assert done.returncode == 0 and status == "200", (command, done.stdout[-800:], done.stderr)
        if '"stream": true' in command:  # OpenAI's chunks, the usage last, then [DONE]
            events = sse_data(body.splitlines())
            assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant", events[:2]
            assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
        else:
            answer = json.loads(body)
            assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"


def test_the_openai_chat_example_runs(chat_server):
    server, root = chat_server
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", CHAT_SECTION, re.S) if "chat.completions" in b)
    snippet = snippet.replace("http://127.0.0.1:8000", server.url) + "\nprint()\nprint(len(messages))\n"
    done = subprocess.run([sys.executable, "-c", snippet], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "4"  # system, user, the reply, the next user message
