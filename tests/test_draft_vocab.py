"""Reduced-vocabulary drafting: a drafter's `draft_vocab_ids` restrict its greedy argmax to N target
ids, in the torch backend, the exported drafter graph (onnxruntime) and exact replay; output stays
equal to plain decoding; checkpoints round-trip; bad ids are one-line user errors; and
`scripts/draft_vocab.py` keeps special and byte-level tokens and never touches the drafter it copies."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockpilot.cli import main
from blockpilot.errors import UserError
from blockpilot.models.checkpoint import DRAFT_VOCAB_KEY, load_drafter, load_target, save_drafter
from blockpilot.runtime.backend import TorchBackend
from blockpilot.runtime.runner import Runner
from blockpilot.training.evaluate import replay_accept_lengths

from builder_fixtures import save_char_tokenizer
from cli_fixtures import BYTE_VOCAB, byte_tokenizer, make_chat_target
from fixtures import TINY, load_script, make_drafter, make_hf_target

VOCAB = TINY["vocab_size"]
DRAFT_VOCAB = torch.arange(41, VOCAB, 2)  # 28 ids, none below 41: a row index returned unmapped is caught
PROMPTS = [[5, 17, 42, 8], [60], list(range(1, 14))]


def with_draft_vocab(drafter_dir: Path, ids: torch.Tensor | None, out: Path) -> Path:
    drafter = load_drafter(drafter_dir)
    drafter.set_draft_vocabulary(ids)
    return save_drafter(drafter, out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft-vocab")
    target = save_char_tokenizer(make_hf_target(tmp, "llama"))
    drafter = make_drafter(tmp, target, block_size=4, layers=2)
    return {"tmp": tmp, "target": target, "drafter": drafter,
            "reduced": with_draft_vocab(drafter, DRAFT_VOCAB, tmp / "drafter-reduced"),
            "identity": with_draft_vocab(drafter, torch.arange(VOCAB), tmp / "drafter-identity")}


def drafts_per_step(backend, prompt: list[int], block_size: int, steps: int = 6) -> list[torch.Tensor]:
    """Drafts `(1, K - 1)` of `steps` decode-loop calls, each step committing one token (the first draft)."""
    state = backend.new_state(1, 32)
    out = backend.prefill(state, torch.tensor([prompt]))
    token, taps, start, pos = out.last_logits.argmax(-1), out.taps, 0, len(prompt)
    drafts = []
    for _ in range(steps):
        drafts.append(backend.draft(state, token, taps, start, pos, block_size))
        taps, start = backend.verify(state, token[:, None], pos).taps, pos  # commit `token` at `pos`
        token, pos = drafts[-1][:, 0], pos + 1
    return drafts


def full_logits_restricted_argmax(backend, prompt, block_size, ids: torch.Tensor) -> list[torch.Tensor]:
    """The reference: full-vocabulary logits with every id outside `ids` masked out, then argmax."""
    class MaskedFull(TorchBackend):
        @torch.inference_mode()
        def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
            t, d = self.target, self.drafter
            block = d.block_embeddings(t.embed_tokens(last_tokens[:, None]),
                                       t.embed_tokens.weight[d.config.mask_token_id], block_size)
            hidden = d(block, torch.arange(block_start, block_start + block_size), new_taps,
                       torch.arange(ctx_start, ctx_start + new_taps.shape[1]), state.drafter_cache,
                       kv_len=ctx_start + new_taps.shape[1])
            logits = t.lm_head(hidden[:, 1:])
            outside = torch.ones(logits.shape[-1], dtype=torch.bool)
            outside[ids] = False
            return logits.masked_fill(outside, float("-inf")).argmax(-1)

    return drafts_per_step(MaskedFull(backend.target, backend.drafter), prompt, block_size)


def torch_backend(models, drafter_key: str) -> TorchBackend:
    return TorchBackend(load_target(models["target"]), load_drafter(models[drafter_key]))


def test_reduced_vocab_drafting_proposes_only_ids_of_its_vocabulary(models):
    reduced, full = torch_backend(models, "reduced"), torch_backend(models, "drafter")
    allowed = set(DRAFT_VOCAB.tolist())
    outside_full = 0
    for prompt in PROMPTS:
        for block_size in (2, 4, 6):
            drafts = drafts_per_step(reduced, prompt, block_size)
            assert {int(i) for d in drafts for i in d.flatten()} <= allowed, (prompt, block_size)
            reference = full_logits_restricted_argmax(full, prompt, block_size, DRAFT_VOCAB)
            assert [d.tolist() for d in drafts] == [r.tolist() for r in reference], (prompt, block_size)
            outside_full += sum(int(i) not in allowed for d in drafts_per_step(full, prompt, block_size)
                                for i in d.flatten())
    assert outside_full > 0, "the full-vocabulary drafter must propose ids outside the list, or this proves nothing"


def test_full_vocab_list_gives_the_same_drafts_as_no_list(models):
    identity, full = torch_backend(models, "identity"), torch_backend(models, "drafter")
    for prompt in PROMPTS:
        for block_size in (2, 4, 6):
            ours, reference = drafts_per_step(identity, prompt, block_size), drafts_per_step(full, prompt, block_size)
            assert [d.tolist() for d in ours] == [r.tolist() for r in reference], (prompt, block_size)


def _generate(runner, ids, **kwargs):
    return runner.generate([torch.tensor(ids)], max_new_tokens=20, end_id=-1, return_dict=True, **kwargs)


def test_greedy_speculative_output_with_a_reduced_vocab_drafter_equals_plain_decoding_torch(models):
    runner = Runner.from_dir(models["target"], drafter_dir=models["reduced"])
    assert runner.backend.drafter.draft_vocab_ids.tolist() == DRAFT_VOCAB.tolist()
    for ids in PROMPTS:
        plain = _generate(runner, ids, block_size=1)["output_ids"].tolist()
        for block_size in (2, 4, 6, 8):
            assert _generate(runner, ids, block_size=block_size)["output_ids"].tolist() == plain, (ids, block_size)


@pytest.fixture(scope="module", params=[False, True], ids=["fp32-drafter-graph", "int4-drafter-copy"])
def reduced_engine(models, request):
    """An engine dir (block sizes 3 and 5, capacity 40) of the tiny target and the reduced-vocab drafter, without
    and with the 4-bit drafter copy onnxruntime drafts with."""
    pytest.importorskip("onnxruntime")
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    engine = models["tmp"] / f"engine-reduced-int4-{request.param}"
    build_engine_dir(BuildSpec(models["target"], models["reduced"], engine, (3, 5), 40, int4_drafter=request.param))
    return engine


def test_drafter_graph_carries_the_ids_and_only_their_lm_head_rows(reduced_engine):
    import onnx

    from blockpilot.builder.manifest import read_manifest
    from trt_onnx import load_graph, parser_problems, profile_problems

    graph = onnx.load(str(reduced_engine / "drafter.onnx")).graph
    shapes = {tuple(i.dims): i.data_type for i in graph.initializer}
    n, h, v = len(DRAFT_VOCAB), TINY["hidden_size"], VOCAB
    assert shapes.get((n,)) == onnx.TensorProto.INT64
    assert (n, h) in shapes or (h, n) in shapes  # the exporter may store the head transposed for MatMul
    assert (h, v) not in shapes and (v, h) in shapes  # the full matrix only once: the embedding
    assert DRAFT_VOCAB_KEY in load_file(reduced_engine / "drafter" / "model.safetensors")  # copied unchanged
    entry = read_manifest(reduced_engine).drafter
    model = load_graph(reduced_engine / entry.onnx)
    assert not parser_problems(model) + profile_problems(model, entry)  # still a graph TensorRT parses


def test_greedy_speculative_output_with_a_reduced_vocab_drafter_equals_plain_decoding_onnxruntime(reduced_engine):
    onnx_runner = Runner.from_dir(reduced_engine, backend="onnxruntime")  # checks every file's hash
    torch_runner = Runner.from_dir(reduced_engine, backend="torch")
    same_drafts = onnx_runner.backend.manifest.ort_drafter is None  # 4-bit weights draft otherwise, in the list
    allowed = set(DRAFT_VOCAB.tolist())
    for ids in PROMPTS:
        plain = _generate(onnx_runner, ids, block_size=1)["output_ids"].tolist()
        for block_size in (3, 5):
            ours = _generate(onnx_runner, ids, block_size=block_size)
            assert ours["output_ids"].tolist() == plain, (ids, block_size)
            drafts = drafts_per_step(onnx_runner.backend, ids, block_size, steps=4)
            assert {int(i) for d in drafts for i in d.flatten()} <= allowed
            if same_drafts:
                assert ours["accept_lengths"] == _generate(torch_runner, ids, block_size=block_size)["accept_lengths"]
                reference = drafts_per_step(torch_runner.backend, ids, block_size, steps=4)
                assert [d.tolist() for d in drafts] == [d.tolist() for d in reference], (ids, block_size)


def test_replay_drafts_over_the_draft_vocabulary_like_the_runtime(models):
    """Exact T=0 replay (tau measurement, labels) uses the same restricted argmax as `TorchBackend.draft`."""
    runner = Runner.from_dir(models["target"], drafter_dir=models["reduced"])
    runner.lookup = "off"  # every step drafts with the drafter, as the replay does
    for ids in PROMPTS:
        out = _generate(runner, ids, block_size=4)
        sequence = out["output_ids"][0, 0, :len(ids) + 20].tolist()
        replayed = replay_accept_lengths(runner.backend.target, runner.backend.drafter, sequence, len(ids), 4,
                                         stop_at=len(ids) + 19)
        assert replayed == out["accept_lengths"][0], ids


def test_drafter_checkpoints_round_trip_with_and_without_draft_vocabulary(models, tmp_path):
    plain, reduced = load_drafter(models["drafter"]), load_drafter(models["reduced"], dtype=torch.float16)
    assert plain.draft_vocab_ids is None
    assert DRAFT_VOCAB_KEY not in load_file(models["drafter"] / "model.safetensors")
    assert reduced.draft_vocab_ids.dtype == torch.int64 and reduced.draft_vocab_ids.tolist() == DRAFT_VOCAB.tolist()
    saved = load_file(save_drafter(reduced, tmp_path / "again") / "model.safetensors")
    assert saved[DRAFT_VOCAB_KEY].dtype == torch.int64 and torch.equal(saved[DRAFT_VOCAB_KEY], DRAFT_VOCAB)
    again = load_drafter(tmp_path / "again")
    assert torch.equal(again.draft_vocab_ids, DRAFT_VOCAB)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor.half().float()), name
    cleared = load_drafter(tmp_path / "again")
    cleared.set_draft_vocabulary(None)
    assert DRAFT_VOCAB_KEY not in load_file(save_drafter(cleared, tmp_path / "cleared") / "model.safetensors")
    assert load_drafter(tmp_path / "cleared").draft_vocab_ids is None


BAD_IDS = {
    "float": (torch.arange(10, 20).float(), "dtype torch.float32, expected int64"),
    "int32": (torch.arange(10, 20, dtype=torch.int32), "dtype torch.int32, expected int64"),
    "2-d": (torch.arange(10, 20).reshape(2, 5), "shape (2, 5), expected (N,)"),
    "empty": (torch.zeros(0, dtype=torch.long), "draft_vocab_ids is empty"),
    "too large": (torch.tensor([3, 50, VOCAB]), f"id {VOCAB} outside the target's vocabulary [0, {VOCAB})"),
    "negative": (torch.tensor([-1, 3, 50]), f"id -1 outside the target's vocabulary [0, {VOCAB})"),
    "repeated": (torch.tensor([3, 7, 7, 9]), "repeats id 7"),
    "unsorted": (torch.tensor([3, 9, 7]), "not sorted ascending (id 7"),
}


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_draft_vocab_ids_are_a_user_error_naming_the_problem(models, case):
    ids, needle = BAD_IDS[case]
    drafter = load_drafter(models["drafter"])
    with pytest.raises(UserError, match="draft_vocab_ids") as raised:
        drafter.set_draft_vocabulary(ids)
    assert needle in str(raised.value) and "\n" not in str(raised.value)
    assert drafter.draft_vocab_ids is None


CLI_BAD_IDS = {  # for the byte-tokenizer target (vocabulary 258)
    "too large": (torch.tensor([3, 50, BYTE_VOCAB]), f"id {BYTE_VOCAB} outside the target's vocabulary [0, {BYTE_VOCAB})"),
    "repeated": (torch.tensor([3, 7, 7, 9]), "repeats id 7"),
    "float": (torch.arange(10, 20).float(), "dtype torch.float32, expected int64"),
}


@pytest.mark.parametrize("case", CLI_BAD_IDS)
def test_bad_draft_vocab_ids_in_a_checkpoint_end_generate_with_one_line_and_exit_2(tmp_path, capsys, case):
    target = make_chat_target(tmp_path)
    drafter = make_drafter(tmp_path, target, block_size=4)
    ids, needle = CLI_BAD_IDS[case]
    save_file({**load_file(drafter / "model.safetensors"), DRAFT_VOCAB_KEY: ids.contiguous()},
              drafter / "model.safetensors")
    with pytest.raises(UserError, match="model.safetensors: draft_vocab_ids"):
        load_drafter(drafter)
    capsys.readouterr()
    code = main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "hi"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("blockpilot generate: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in captured.err


# ---------------------------------------------------------------- scripts/draft_vocab.py


@pytest.fixture(scope="module")
def draft_vocab_script():
    yield load_script("draft_vocab")
    sys.modules.pop("draft_vocab", None)


def test_byte_level_and_special_tokens_are_always_kept(draft_vocab_script, models):
    assert draft_vocab_script.always_kept_ids(byte_tokenizer(), BYTE_VOCAB).tolist() == list(range(BYTE_VOCAB))
    from blockpilot.text import load_tokenizer

    char_tokenizer = load_tokenizer(models["target"])  # not byte-level: only <unk>, <s>, </s>
    assert draft_vocab_script.always_kept_ids(char_tokenizer, VOCAB).tolist() == [0, 1, 2]


def test_script_writes_the_most_frequent_ids_into_a_copy_and_leaves_the_drafter_untouched(
        draft_vocab_script, models, tmp_path, capsys):
    import json

    answers = tmp_path / "answers.jsonl"
    rows = [{"prompt": "p", "answer": "", "answer_ids": [50] * 6 + [60] * 4 + [70] * 2, "finish": "length"},
            {"prompt": "q", "answer": "aaa", "finish": "stop"}]  # text: tokenized; stop: + </s> (id 2)
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    original = models["drafter"] / "model.safetensors"
    before = hashlib.sha256(original.read_bytes()).hexdigest()
    out = tmp_path / "copy"
    code = draft_vocab_script.main(["--drafter", str(models["drafter"]), "--target", str(models["target"]),
                                    "--answers", str(answers), "--n", "6", "--out", str(out)])
    report = json.loads(capsys.readouterr().out)
    from blockpilot.text import load_tokenizer

    a = load_tokenizer(models["target"])("a", add_special_tokens=False)["input_ids"][0]
    assert code == 0 and hashlib.sha256(original.read_bytes()).hexdigest() == before
    assert load_drafter(out).draft_vocab_ids.tolist() == sorted({0, 1, 2, 50, 60, a})  # 70: the least frequent
    assert report["coverage"] == pytest.approx((6 + 4 + 3 + 1) / 16)
    copied, source = load_file(out / "model.safetensors"), load_file(original)
    assert set(copied) - set(source) == {DRAFT_VOCAB_KEY}
    assert all(torch.equal(copied[k].view(torch.uint8), source[k].view(torch.uint8)) for k in source)
    assert draft_vocab_script.main(["--drafter", str(models["drafter"]), "--target", str(models["target"]),
                                    "--answers", str(answers), "--n", "6", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert draft_vocab_script.main(["--drafter", str(models["drafter"]), "--target", str(models["target"]),
                                    "--answers", str(answers), "--n", "2", "--out", str(tmp_path / "small")]) == 2
    assert "always-kept" in capsys.readouterr().err
