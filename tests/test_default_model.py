"""The embedded default model, tiny-chat (refengine/data/models/tiny-chat, trained by
refengine.model.train): the shipped folder is the recorded training run, the float64 reference gives
the seed experiment's eight answers, training renders chats exactly as inference does, eight
concurrent clients over HTTP get what each gets alone, and retraining reproduces it."""
from __future__ import annotations

import hashlib
import json
import time

import pytest
from tokenizers import Tokenizer as HFTokenizer

from refengine.check.golden import load_prompts
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.model import load_model
from refengine.model.cache import default_model_dir
from refengine.model.train import (
    TINY_CHAT,
    TRAINING_DATA,
    encode_examples,
    read_examples,
)
from refengine.reference import generate
from refengine.sampling import SamplingParams
from refengine.serve import OpenAIServer

# The seed article (shared/seeds/000, section 3): eight short chat questions on the board, batched and
# serial, "Blue / Tokyo / tea / Green / Paris / coffee / Purple / Berlin", byte-identical in both modes.
SEED_ANSWERS = {"favourite-colour": "Blue", "capital-japan": "Tokyo", "tea-or-coffee": "tea", "green-thing": "Green",
                "capital-france": "Paris", "another-drink": "coffee", "purple": "Purple", "capital-germany": "Berlin"}
# The shipped folder's fingerprint: a change to its files must be a deliberate retraining
FINGERPRINT = "sha256:d8aa387a50c1582ae9d2c4e1dd3095915cdc1c1bf85e46e90ad7707fe3a597dc"
CLEAR_DECISION = 1.0  # every step of the eight answers decided by more than this top-2 margin
RUN_KEYS = ("data", "data_sha256", "examples", "tokens", "seed", "steps", "learning_rate", "warmup_steps",
            "weight_decay", "label_smoothing", "model")  # what defines a training run (not where it ran)


def seed_questions():
    cases = [c for c in load_prompts(shipped("golden", "prompts", "seed-experiment.jsonl")) if c.id in SEED_ANSWERS]
    assert [c.id for c in cases] == list(SEED_ANSWERS)
    return cases


def words(text: str) -> list[str]:
    return text.replace(".", " ").replace(",", " ").split()


def test_the_shipped_folder_is_the_recorded_training_run(default_model):
    folder = default_model_dir()
    assert default_model.fingerprint == FINGERPRINT
    recipe = json.loads((folder / "refengine_trained.json").read_text())
    assert recipe["data_sha256"] == hashlib.sha256(shipped(*TRAINING_DATA).read_bytes()).hexdigest()
    assert recipe["model"] == TINY_CHAT.recipe()
    cfg = default_model.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == \
        (TINY_CHAT.arch, TINY_CHAT.layers, TINY_CHAT.hidden, TINY_CHAT.vocab, TINY_CHAT.tie)
    assert sum(p.stat().st_size for p in folder.iterdir()) < 600_000  # package data of a few hundred KB


def answer(model, case) -> tuple[str, list[float]]:
    out = generate(model, model.tokenizer.encode_chat(case.messages), SamplingParams(max_tokens=case.max_tokens))
    return model.tokenizer.decode(out.token_ids), [s.top2_margin for s in out.steps]


def test_the_float64_reference_gives_the_seed_experiments_eight_answers(default_model):
    for case in seed_questions():
        text, margins = answer(default_model, case)
        assert SEED_ANSWERS[case.id] in words(text), (case.id, text)
        assert min(margins) > CLEAR_DECISION, (case.id, margins)


def test_training_renders_a_chat_exactly_as_inference_does(default_model):
    """The tokens a reply was learned after are the tokens `encode_chat` sends at inference: the chat
    template's generation prompt, then the reply and <|im_end|>."""
    examples = read_examples(shipped(*TRAINING_DATA))
    tokenizer = HFTokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    chats = [(e, enc) for e, enc in zip(examples, encode_examples(examples, tokenizer)) if "messages" in e]
    assert len(chats) >= len(SEED_ANSWERS)
    template = default_model.tokenizer
    for example, (tokens, learned) in chats:
        messages = example["messages"]
        assert tokens == template.encode_chat(messages, add_generation_prompt=False)
        prompt = template.encode_chat(messages[:-1])  # up to and including "<|im_start|>assistant\n"
        reply = learned.index(True)
        assert tokens[:reply] == prompt and not any(learned[:reply])
        assert tokens[reply:] == template.encode(messages[-1]["content"] + "<|im_end|>\n", add_special_tokens=False)


@pytest.mark.parametrize("line, where", [
    ('{"text": 5}', ":1:"),
    ('{"messages": [{"role": "user"}]}', ":1: messages[0]"),
    ('{"text": "a"}\n[1, 2]', ":2:"),
    ('{"text": "a"', ":1:"),
])
def test_bad_training_examples_are_named_before_training(tmp_path, capsys, line, where):
    data = tmp_path / "examples.jsonl"
    data.write_text(line + "\n")
    assert main(["train-tiny-chat", str(tmp_path / "out"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{data}{where}" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_training_file_is_named(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["train-tiny-chat", str(tmp_path / "out"), "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(missing) in err


def hold_until_all_eight_arrive(server: OpenAIServer, deadline_s: float = 60.0) -> None:
    """After validate's eight alone requests, the server steps nothing until the eight concurrent ones
    are all in its engine: they share every step however slowly a loaded machine starts the clients
    (without it, one request on a busy machine may run before another arrives, and miss the batch).
    validate's dialect probe (max_tokens 1) comes first and is not counted."""
    engine, step, add = server.engine, server.engine.step, server.engine.add_request
    added: list[float] = []

    def counted_add(*args, **kwargs):
        if kwargs["params"].max_tokens > 1:
            added.append(time.monotonic())
        return add(*args, **kwargs)

    def held_step():
        if len(added) > 8 and len(added) < 16 and time.monotonic() - added[8] < deadline_s:
            time.sleep(0.001)  # the engine thread admits the next arrival between steps
            return []
        return step()

    engine.add_request, engine.step = counted_add, held_step


@pytest.mark.parametrize("fault", [None, "logits-rows-misassigned-after-leave"])
def test_eight_concurrent_clients_get_what_each_gets_alone(default_model, tmp_path, fault):
    """The seed experiment over HTTP: the eight questions sent at once by eight clients, each answer
    bit-identical to the same question sent alone (validate's serial baseline), and each the seed's;
    with a batching fault (the short answers leave the batch one after another) the same run fails."""
    prompts = tmp_path / "eight.jsonl"
    prompts.write_text("".join(json.dumps({"id": c.id, "messages": c.messages, "max_tokens": c.max_tokens}) + "\n"
                               for c in seed_questions()))
    server = OpenAIServer(default_model, EngineConfig(max_num_seqs=8, fault=fault), host="127.0.0.1")
    hold_until_all_eight_arrive(server)
    server.start()
    try:
        report = tmp_path / "report.json"
        code = main(["validate", "--url", server.url, "--prompts", str(prompts), "--concurrency", "8",
                     "--arrival-spread", "0", "--cancel-rate", "0", "--seed", "1", "--variant-rate", "0",
                     "--report", str(report),
                     "--repro", str(tmp_path / "repro.json")])
        max_batch = server.engine.metrics["max_batch_size"]
    finally:
        server.close()
    data = json.loads(report.read_text())
    assert data["overlap"]["overlapped"] == 8 and max_batch == 8  # they did share engine steps
    verdicts = [r["verdict"] for r in data["requests"]]
    if fault:
        assert code == 1 and data["summary"]["verdict"] == "FAIL" and "diverged" in verdicts
        return
    assert code == 0 and data["summary"]["verdict"] == "PASS" and verdicts == ["match"] * 8
    assert {r["case"]: SEED_ANSWERS[r["case"]] in words(r["text"]) for r in data["requests"]} == \
        dict.fromkeys(SEED_ANSWERS, True)


@pytest.mark.slow
def test_retraining_reproduces_the_shipped_model(tmp_path):
    """`refengine train-tiny-chat` (torch and transformers, single-threaded, seeded) writes the
    shipped tokenizer, config and recipe, and a model that gives the eight answers. Its weights are
    byte-identical on the CPU and torch build that made the shipped folder; another CPU may round the
    800 steps' sums differently in the last bits, so the weights are not held to the shipped bytes:
    their answers are."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "tiny-chat"
    assert main(["train-tiny-chat", str(out)]) == 0
    shipped_folder = default_model_dir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (shipped_folder / name).read_bytes(), name
    recipes = [json.loads((folder / "refengine_trained.json").read_text()) for folder in (out, shipped_folder)]
    assert {k: recipes[0][k] for k in RUN_KEYS} == {k: recipes[1][k] for k in RUN_KEYS}
    retrained = load_model(out)
    for case in seed_questions():
        text, _ = answer(retrained, case)
        assert SEED_ANSWERS[case.id] in words(text), (case.id, text)
