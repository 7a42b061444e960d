"""The playground at `/`, end to end: headless Chromium (driven by selenium) against a real server, with no
network but the server's (the page must work air-gapped).

docs/playground.png is this test's screenshot of the page: TSERVE_UPDATE_SCREENSHOT=1 writes it. The chat view
talks to a tiny random instruct model with a ChatML template (tests/deploy/chat_model.py) on a server of its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.browser import OFFLINE_FLAGS, By, Select, chromium_driver, severe_console_errors, wait
from tests.deploy.chat_model import chat_model_directory
from tests.model.test_token_entities import token_classifier
from tests.service.conftest import LM, MT
from tests.service.server import Server, running_server

CLS = "tiny-cls"
CHAT = "tiny-chat"
NER = "tiny-ner"  # a random BertForTokenClassification
SOURCE = "the cat sat on the mat"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path) -> Iterator[Server]:
    with running_server(models_dir, adapters_dir) as s:
        # The page's files, beside index.html.
        for name in ("playground.js", "chat.js", "rerank.js", "entities.js", "playground.css"):
            r = httpx.get(f"{s.url}/static/{name}", timeout=10)
            assert r.status_code == 200, (f"GET /static/{name}: {r.status_code}: the service must serve "
                                     "service/api/static/")
        yield s


@pytest.fixture
def browser(chromium: tuple[str, str], tmp_path: Path) -> Iterator:
    with chromium_driver(chromium, tmp_path / "chromium-profile", OFFLINE_FLAGS) as driver:
        yield driver


def open_model(driver, server: Server, model: str) -> None:
    driver.get(f"{server.url}/?model={model}")
    wait(driver, lambda d: Select(d.find_element(By.ID, "model")).first_selected_option.get_attribute("value") == model)
    wait(driver, lambda d: d.find_element(By.ID, "adapter").find_elements(By.TAG_NAME, "option"))


def status(driver) -> str:
    return driver.find_element(By.ID, "status").text


def fill(driver, element_id: str, text: str) -> None:
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(text)


def set_checkbox(driver, element_id: str, on: bool) -> None:
    box = driver.find_element(By.ID, element_id)
    if box.is_selected() != on:
        box.click()


def output_text(driver) -> str:
    return driver.execute_script("return document.getElementById('gen-output').textContent;")


def cells(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#heatmap svg rect.cell")


def cell_weights(driver) -> dict[tuple[int, int], float]:
    """(query, key) -> the weight drawn, read in one script call (one WebDriver call per cell is slow)."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#heatmap svg rect.cell')]"
        ".map(c => [+c.dataset.q, +c.dataset.k, +c.dataset.w]);")
    return {(q, k): w for q, k, w in rows}


def test_translate_then_attention_heatmap(browser, server: Server):
    open_model(browser, server, MT)
    assert browser.find_element(By.ID, "task-title").text == "Translate"
    fill(browser, "gen-input", SOURCE)
    Select(browser.find_element(By.ID, "gen-strategy")).select_by_value("greedy")
    set_checkbox(browser, "gen-stream", False)
    browser.find_element(By.ID, "gen-run").click()
    wait(browser, lambda d: d.find_element(By.ID, "gen-output").get_attribute("data-done") == "true" or status(d))
    assert not status(browser), status(browser)
    expected = httpx.post(f"{server.url}/v1/models/{MT}/generate", json={
        "inputs": [SOURCE], "strategy": "greedy", "max_new_tokens": 32}, timeout=30).json()["outputs"][0]["text"]
    assert output_text(browser) == expected

    # The translation's attention: source from the input, target from the output.
    browser.find_element(By.ID, "gen-to-attention").click()
    wait(browser, lambda d: cells(d) or status(d))
    assert not status(browser), status(browser)
    reference = httpx.post(f"{server.url}/v1/models/{MT}/attention",
                           json={"input": SOURCE, "target": expected}, timeout=30).json()
    src, tgt = len(reference["source_tokens"]), len(reference["target_tokens"])
    kinds = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#attn-kind option")]
    assert set(kinds) == set(reference["maps"]) == {"encoder_self", "decoder_self", "cross"}

    shapes = {"encoder_self": (src, src), "decoder_self": (tgt, tgt), "cross": (tgt, src)}
    for kind, (rows, cols) in shapes.items():
        Select(browser.find_element(By.ID, "attn-kind")).select_by_value(kind)
        weights = wait(browser, lambda d, n=rows * cols: (w := cell_weights(d)) and len(w) == n and w)
        assert len(browser.find_elements(By.CSS_SELECTOR, "#heatmap text.label.query")) == rows
        assert len(browser.find_elements(By.CSS_SELECTOR, "#heatmap text.label.key")) == cols
        # The drawn weights are the server's, cell by cell (layer 1, head 1 selected).
        layer, head = 0, 0
        matrix = reference["maps"][kind][layer][head]
        assert all(abs(weights[q, k] - matrix[q][k]) < 1e-3 for q in range(rows) for k in range(cols))

    # Another layer and head redraw the grid with other weights.
    Select(browser.find_element(By.ID, "attn-kind")).select_by_value("encoder_self")
    before = cell_weights(browser)
    layers = Select(browser.find_element(By.ID, "attn-layer"))
    heads = Select(browser.find_element(By.ID, "attn-head"))
    assert len(layers.options) == len(reference["maps"]["encoder_self"])
    assert len(heads.options) == len(reference["maps"]["encoder_self"][0]) + 1  # + mean of heads
    layers.select_by_index(len(layers.options) - 1)
    heads.select_by_index(1)
    wait(browser, lambda d: cell_weights(d) != before)
    assert len(cell_weights(browser)) == src * src
    assert f"layer {len(layers.options)} · head 2" in browser.find_element(By.ID, "attn-caption").text
    assert not severe_console_errors(browser)


def test_streamed_generation_arrives_in_pieces(browser, server: Server):
    open_model(browser, server, LM)
    assert browser.find_element(By.ID, "task-title").text == "Generate"
    fill(browser, "gen-input", "the quick brown fox")
    fill(browser, "gen-max", "12")
    set_checkbox(browser, "gen-stream", True)
    # Record the text of every change of the output. Per mutation record, not per observer callback:
    # events that arrive in one network chunk are rendered in one task, so one callback sees them all.
    browser.execute_script("""
        window.pieces = [];
        const out = document.getElementById('gen-output');
        new MutationObserver((records) => {
            for (const record of records) {
                for (const node of record.addedNodes) window.pieces.push(node.textContent);
                if (record.type === 'characterData') window.pieces.push(record.target.textContent);
            }
        }).observe(out, {childList: true, characterData: true, subtree: true});
    """)
    browser.find_element(By.ID, "gen-run").click()
    wait(browser, lambda d: d.find_element(By.ID, "gen-output").get_attribute("data-done") == "true" or status(d))
    assert not status(browser), status(browser)
    meta = browser.find_element(By.ID, "gen-meta").text
    assert "streamed" in meta
    pieces = browser.execute_script("return window.pieces;")
    expected = httpx.post(f"{server.url}/v1/models/{LM}/generate", json={
        "inputs": ["the quick brown fox"], "max_new_tokens": 12}, timeout=30).json()["outputs"][0]
    assert output_text(browser) == expected["text"]
    assert f"{len(expected['tokens'])} tokens" in meta
    if len(expected["tokens"]) > 1:
        assert len(pieces) > 1, f"the output changed only {len(pieces)} time(s): not streamed"
        # Each piece extends the one before, up to the whole text.
        assert all(b.startswith(a) for a, b in zip(pieces, pieces[1:], strict=False)), pieces
        assert pieces[-1] == expected["text"]
    assert not severe_console_errors(browser)


def test_classify_with_adapter(browser, server: Server):
    open_model(browser, server, CLS)
    assert browser.find_element(By.ID, "task-title").text == "Classify"
    Select(browser.find_element(By.ID, "adapter")).select_by_value("cls-a")
    fill(browser, "cls-input", "all that glitters is not gold")
    browser.find_element(By.ID, "cls-run").click()
    rows = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#cls-output .prob") or status(d))
    assert not status(browser), status(browser)
    expected = httpx.post(f"{server.url}/v1/models/{CLS}/classify", json={
        "inputs": ["all that glitters is not gold"], "adapter": "cls-a"}, timeout=30).json()["outputs"][0]
    assert len(rows) == len(expected["probabilities"])
    assert browser.find_element(By.CSS_SELECTOR, "#cls-output .prob.best span").text == expected["label"]
    assert not severe_console_errors(browser)


# Record the body of every rerank request the page sends.
RECORD_RERANK = """
    window.sent = [];
    const pageFetch = window.fetch;
    window.fetch = (url, init) => {
        if (String(url).endsWith('v1/rerank')) window.sent.push(JSON.parse(init.body));
        return pageFetch(url, init);
    };
"""


def rank_rows(driver) -> list[tuple[int, float, str, str]]:
    """(index, score, score as shown, document) of each bar of the rerank panel, top to bottom."""
    return [tuple(row) for row in driver.execute_script(
        "return [...document.querySelectorAll('#rerank-output li.rank')].map((li) => [+li.dataset.index, "
        "+li.dataset.score, li.querySelector('.score').textContent, li.querySelector('.doc').textContent]);")]


def test_rerank_bars_in_the_servers_order_with_adapter(browser, server: Server):
    """The classifier's rerank panel (tiny-cls: embedding cosine) draws the server's ranking of the documents for
    the model:adapter picked, and shows a 4xx as the page's error."""
    query, adapter = "where did the cat sleep", "cls-a"
    model = f"{CLS}:{adapter}"
    ranked = httpx.post(f"{server.url}/v1/rerank", timeout=30, json={
        "model": model, "query": query, "documents": ["a dog barked at the mailman", "the cat slept on the mat",
                                                      "interest rates rose again"]}).json()["results"]
    # Typed least relevant first: the page must reorder them (each document's score does not depend on the others).
    documents = [r["document"]["text"] for r in reversed(ranked)]

    open_model(browser, server, CLS)
    browser.execute_script(RECORD_RERANK)
    assert browser.find_element(By.ID, "rerank-form").get_attribute("hidden") is not None
    browser.find_element(By.ID, "panel-rerank").click()
    assert browser.find_element(By.ID, "task-title").text == "Rerank"
    assert browser.find_element(By.ID, "classify-form").get_attribute("hidden") is not None
    Select(browser.find_element(By.ID, "adapter")).select_by_value(adapter)
    fill(browser, "rerank-query", query)
    fill(browser, "rerank-docs", "\n".join(documents))
    browser.find_element(By.ID, "rerank-run").click()
    rows = wait(browser, lambda d: rank_rows(d) or status(d))
    assert not status(browser), status(browser)

    [sent] = browser.execute_script("return window.sent;")
    assert sent["model"] == model and sent["query"] == query and sent["documents"] == documents
    expected = httpx.post(f"{server.url}/v1/rerank", json=sent, timeout=30).json()
    assert [r["index"] for r in expected["results"]] == [2, 1, 0]
    assert [(i, text) for i, _, _, text in rows] == [(r["index"], documents[r["index"]]) for r in expected["results"]]
    for (_, score, shown, _), r in zip(rows, expected["results"], strict=True):
        assert abs(score - r["relevance_score"]) < 1e-6 and shown == f"{r['relevance_score']:.3f}", (rows, expected)
    meta = browser.find_element(By.ID, "rerank-meta").text
    assert f"scored by {expected['scored_by']}" in meta and model in meta, meta

    # No documents: the server's 422, naming the field, in the page's status line; the bars are cleared.
    fill(browser, "rerank-docs", " ")
    browser.find_element(By.ID, "rerank-run").click()
    wait(browser, lambda d: status(d))
    assert status(browser).startswith("422 ") and "documents" in status(browser), status(browser)
    assert not rank_rows(browser)
    refused = [e for e in severe_console_errors(browser) if not ("v1/rerank" in e and " 422 " in e)]
    assert not refused, refused


@pytest.fixture(scope="module")
def ner_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server over a token classifier (tests/model/test_token_entities.py's, its head scaled for varied labels)
    and tiny-cls (a sequence classifier: no entities)."""
    models = tmp_path_factory.mktemp("ner") / "models"
    token_classifier(models / NER, "bert-cased")
    os.symlink(models_dir / CLS, models / CLS)
    with running_server(models, TSERVE_WARMUP="false") as s:
        yield s


def entity_marks(driver) -> list[tuple[str, str, float, str, str]]:
    """(text, label, score, title, background colour) of each highlighted span of the entities panel, in order."""
    return [tuple(m) for m in driver.execute_script(
        "return [...document.querySelectorAll('#entities-output mark.entity')].map((m) => [m.textContent, "
        "m.dataset.label, +m.dataset.score, m.title, m.style.backgroundColor]);")]


def entities_drawn(driver) -> bool:
    return driver.find_element(By.ID, "entities-output").get_attribute("data-done") == "true"


def test_entities_panel_highlights_the_servers_spans_only_for_token_classifiers(browser, ner_server: Server):
    """The token classifier's entities panel draws the text with the server's entities highlighted, cut at their
    code-point offsets (an emoji, two UTF-16 units, before them all; accents; CJK), one colour per label, the text
    kept as text (markup typed in is not parsed); a sequence classifier has no such panel; a 4xx is the page's error."""
    text = "😀 Zoë Müller <b>flew</b> from Zürich to 東京, 日本."
    tasks = {m["name"]: m["tasks"] for m in httpx.get(f"{ner_server.url}/v1/models", timeout=10).json()["data"]}
    assert "entities" in tasks[NER] and "entities" not in tasks[CLS], tasks
    open_model(browser, ner_server, CLS)
    assert not browser.find_elements(By.ID, "panel-entities")
    assert browser.find_element(By.ID, "entities-form").get_attribute("hidden") is not None

    Select(browser.find_element(By.ID, "model")).select_by_value(NER)  # picked in the page: its panels follow
    wait(browser, lambda d: d.find_elements(By.ID, "panel-entities"))
    assert browser.find_element(By.ID, "task-title").text == "Entities"
    assert browser.find_element(By.ID, "classify-form").get_attribute("hidden") is not None
    strategies = Select(browser.find_element(By.ID, "entities-strategy"))
    assert strategies.first_selected_option.get_attribute("value") == "simple"
    # Typed, but for the emoji: ChromeDriver types only characters of the BMP, so the page's script inserts it.
    fill(browser, "entities-input", text[1:])
    browser.execute_script("document.getElementById('entities-input').setRangeText(arguments[0], 0, 0);", text[0])
    assert browser.find_element(By.ID, "entities-input").get_attribute("value") == text
    for strategy, key in (("simple", "entity_group"), ("none", "entity")):
        strategies.select_by_value(strategy)
        browser.find_element(By.ID, "entities-run").click()
        wait(browser, lambda d: entities_drawn(d) or status(d))
        assert not status(browser), status(browser)
        expected = httpx.post(f"{ner_server.url}/v1/models/{NER}/entities", timeout=30, json={
            "inputs": [text], "aggregation_strategy": strategy}).json()["outputs"][0]
        marks = entity_marks(browser)
        assert [(m[0], m[1]) for m in marks] == [(text[e["start"]:e["end"]], e[key]) for e in expected], strategy
        assert all(abs(m[2] - e["score"]) < 1e-6 and m[3] == f"{e[key]} · {e['score']:.3f}"
                   for m, e in zip(marks, expected, strict=True)), (marks, expected)
        # Entities after the emoji, on accented and CJK characters: a cut in UTF-16 units would shift them all.
        assert any(e["start"] > 0 for e in expected) and {"ü", "東"} <= set("".join(m[0] for m in marks)), expected
        # The whole text, in nothing but text nodes and marks: the typed <b> stays text.
        assert browser.execute_script(
            "const out = document.getElementById('entities-output');"
            "return [out.textContent, [...out.querySelectorAll('*')].every((e) => e.matches('mark.entity'))];"
        ) == [text, True]
        colours = {label: colour for _, label, _, _, colour in marks}
        assert len(colours) == len(set(colours.values())), colours  # one colour per label
        legend = browser.execute_script(
            "return [...document.querySelectorAll('#entities-legend .legend-item')].map((i) => "
            "[i.dataset.label, i.querySelector('.swatch').style.backgroundColor]);")
        assert dict(legend) == colours and len(legend) == len(colours), (legend, colours)

    # No text: the server's 422, naming the field, in the page's status line; the spans are cleared.
    browser.find_element(By.ID, "entities-input").clear()
    browser.find_element(By.ID, "entities-run").click()
    wait(browser, lambda d: status(d))
    assert status(browser).startswith("422 ") and "inputs" in status(browser), status(browser)
    assert not entity_marks(browser) and not entities_drawn(browser)
    refused = [e for e in severe_console_errors(browser) if not ("/entities" in e and " 422 " in e)]
    assert not refused, refused


def test_entity_offsets_count_code_points_not_utf16_units(browser, ner_server: Server):
    """The panel's cut of a text at the service's offsets (Python str indices: code points) is Python's slicing,
    with characters outside the BMP (two UTF-16 units each) before and inside the entities."""
    open_model(browser, ner_server, NER)
    cases = {"😀 Köln": [(2, 6)], "Köln 😀😀 東京 e\u0301!": [(0, 4), (8, 10), (11, 13)],
             "a 👩\u200d👩\u200d👧 b 𝔘𝔫𝔦": [(2, 7), (10, 13)]}
    for text, offsets in cases.items():
        entities = [{"entity_group": "X", "score": 0.5, "start": start, "end": end} for start, end in offsets]
        cut = browser.execute_script(
            "return entitySegments(arguments[0], arguments[1]).map((s) => [s.text, s.entity !== null]);",
            text, entities)
        bounds = [0, *[i for pair in offsets for i in pair], len(text)]
        expected = [[text[a:b], k % 2 == 1] for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
                    if a < b]
        assert cut == expected, text
    assert not severe_console_errors(browser)


def card_texts(driver) -> tuple[str, str]:
    """(the task card's input, the attention card's input) as the page holds them now."""
    task, attention = driver.execute_script(
        "const task = document.querySelector('#task form:not([hidden]) textarea');"
        "return [task.value, document.getElementById('attn-input').value];")
    return task, attention


def test_each_cards_default_text_follows_the_model(browser, server: Server):
    """Both cards open on one example of the selected model's kind (not code beside an English sentence), and
    change with the model picked in the page."""
    defaults = {}
    for model in (LM, MT, CLS):
        open_model(browser, server, model)
        task, attention = card_texts(browser)
        assert task.strip() and attention == task, (model, task, attention)
        defaults[model] = task
    assert len(set(defaults.values())) == 3, defaults
    assert browser.find_element(By.ID, "attn-target").get_attribute("value") == ""

    for model in (MT, LM):  # picked in the page this time (its change event), from the classifier's page
        Select(browser.find_element(By.ID, "model")).select_by_value(model)
        wait(browser, lambda d, m=model: card_texts(d) == (defaults[m], defaults[m]))
    # A sentiment classifier's example is one it can tell: the model is sure of it either way.
    expected = httpx.post(f"{server.url}/v1/models/{CLS}/classify", json={"inputs": [defaults[CLS]]},
                          timeout=30).json()["outputs"][0]
    assert max(expected["probabilities"].values()) > 0.9, (defaults[CLS], expected)
    assert not severe_console_errors(browser)


def test_screenshot_of_the_page_as_it_opens(browser, server: Server, tmp_path: Path):
    """The classifier's page with its default text classified and its attention drawn: docs/playground.png."""
    open_model(browser, server, CLS)
    browser.find_element(By.ID, "cls-run").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#cls-output .prob") or status(d))
    assert not status(browser), status(browser)
    # Attention of the encoder, "like the matrices in the literature".
    browser.find_element(By.ID, "attn-run").click()
    wait(browser, lambda d: cells(d) or status(d))
    assert not status(browser), status(browser)
    n = len(browser.find_elements(By.CSS_SELECTOR, "#heatmap text.label.query"))
    assert n > 3 and len(cells(browser)) == n * n

    # The whole page, without a scroll bar: the window grows to the height of its content.
    height = browser.execute_script("return document.documentElement.scrollHeight + outerHeight - innerHeight;")
    browser.set_window_size(browser.get_window_size()["width"], height)
    shot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("TSERVE_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
    assert not severe_console_errors(browser)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("chat") / "models"
    chat_model_directory(models / CHAT)
    with running_server(models, TSERVE_WARMUP="false") as s:
        yield s


# Record the body of every chat request the page sends, and every change of an assistant reply's text (per
# mutation record: chunks that arrive in one network read are still drawn one by one).
RECORD_CHAT = """
    window.sent = [];
    const pageFetch = window.fetch;
    window.fetch = (url, init) => {
        if (String(url).endsWith('chat/completions')) window.sent.push(JSON.parse(init.body));
        return pageFetch(url, init);
    };
    window.pieces = [];
    new MutationObserver((records) => {
        for (const record of records) {
            const content = record.target.closest && record.target.closest('li.assistant .content');
            if (!content) continue;
            const replies = [...document.querySelectorAll('#chat-log li.assistant')];
            window.pieces.push([replies.indexOf(content.closest('li')), content.textContent]);
        }
    }).observe(document.getElementById('chat-log'), {childList: true, characterData: true, subtree: true});
"""


def chat_log(driver) -> list[tuple[str, str]]:
    """(role, text) of every message drawn in the conversation."""
    return [tuple(m) for m in driver.execute_script(
        "return [...document.querySelectorAll('#chat-log li')].map((li) => "
        "[li.dataset.role, li.querySelector('.content').textContent]);")]


def say(driver, text: str) -> None:
    """Send ``text`` and wait for its reply to finish (or the error line)."""
    done = len(driver.find_elements(By.CSS_SELECTOR, "#chat-log li.assistant[data-done]"))
    fill(driver, "chat-input", text)
    driver.find_element(By.ID, "chat-send").click()
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat-log li.assistant[data-done]")) > done
         or d.find_element(By.ID, "chat-error").text)


def test_chat_two_turns_streamed_the_second_carrying_the_first(browser, chat_server: Server):
    browser.get(f"{chat_server.url}/?tab=chat")
    wait(browser, lambda d: d.find_element(By.ID, "chat-model").get_attribute("value") == CHAT)
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-adapter option"))
    assert browser.find_element(By.ID, "models-view").get_attribute("hidden") is not None
    browser.execute_script(RECORD_CHAT)
    fill(browser, "chat-system", "Answer briefly.")
    fill(browser, "chat-max", "8")
    say(browser, "the quick brown fox")
    say(browser, "print('hello')")
    assert not browser.find_element(By.ID, "chat-error").text, browser.find_element(By.ID, "chat-error").text

    first, second = browser.execute_script("return window.sent;")
    log = chat_log(browser)
    assert [role for role, _ in log] == ["user", "assistant", "user", "assistant"]
    reply = log[1][1]
    system = {"role": "system", "content": "Answer briefly."}
    assert first["messages"] == [system, {"role": "user", "content": "the quick brown fox"}]
    assert second["messages"] == [*first["messages"], {"role": "assistant", "content": reply},
                                  {"role": "user", "content": "print('hello')"}]
    assert second["stream"] is True and second["model"] == CHAT
    # Each streamed reply is what the server answers the same conversation unstreamed (greedy: temperature 0).
    for body, (_, drawn) in zip((first, second), (log[1], log[3]), strict=True):
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        answer = httpx.post(f"{chat_server.url}/v1/chat/completions", json=plain, timeout=30).json()
        assert drawn == answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] > 1  # more than one chunk to stream
    # The second reply was drawn chunk by chunk, each piece extending the one before, up to the whole reply.
    pieces = [text for turn, text in browser.execute_script("return window.pieces;") if turn == 1]
    assert len(pieces) > 1 and all(b.startswith(a) for a, b in zip(pieces, pieces[1:], strict=False)), pieces
    assert pieces[-1] == log[3][1]
    assert "tokens" in browser.find_element(By.ID, "chat-meta").text

    # A 4xx shows the server's error and leaves the conversation as it was; "new chat" starts from nothing.
    fill(browser, "chat-max", "100000")
    say(browser, "one more")
    error = browser.find_element(By.ID, "chat-error").text
    assert error.startswith("422 ") and "max_tokens" in error, error
    assert chat_log(browser) == log
    assert browser.find_element(By.ID, "chat-input").get_attribute("value") == "one more"
    browser.find_element(By.ID, "chat-new").click()
    assert chat_log(browser) == [] and not browser.find_element(By.ID, "chat-error").text
    fill(browser, "chat-max", "4")
    say(browser, "hello again")
    assert browser.execute_script("return window.sent;")[-1]["messages"] == [
        system, {"role": "user", "content": "hello again"}]
    assert [role for role, _ in chat_log(browser)] == ["user", "assistant"]
    refused = [e for e in severe_console_errors(browser) if not ("chat/completions" in e and " 422 " in e)]
    assert not refused, refused
