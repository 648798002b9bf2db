"""The block-size policy: prefill features, the choice math, and `auto` in the runner with an ONNX predictor."""

import json

import pytest
import torch

from blockpilot.errors import UserError
from blockpilot.predictor.export import export_predictor
from blockpilot.predictor.model import BlockSizeMLP
from blockpilot.runtime.policy import (
    OnnxBlockSizePolicy,
    PredictorInfo,
    model_files_sha256,
    prefill_features,
    select_block_size,
)
from blockpilot.runtime.runner import Runner

from fixtures import make_drafter, make_hf_target

CANDIDATES = (6, 7, 8, 9, 10)  # the fixture drafter's B_train is 8
PROMPT = [5, 17, 42, 8, 60, 33]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy")
    target = make_hf_target(tmp, "llama")
    drafter = make_drafter(tmp, target, block_size=8)
    return tmp, target, drafter


def _info(target, drafter, **changes) -> PredictorInfo:
    fields = dict(candidates=CANDIDATES, feature_kind="pooled", input_width=32, objective="tau", b_train=8,
                  with_temperature=False, target_sha256=model_files_sha256(target),
                  drafter_sha256=model_files_sha256(drafter), threshold=0.0)
    return PredictorInfo(**{**fields, **changes})


def _constant_predictor(path, info: PredictorInfo, probabilities: list[float]):
    """A predictor whose output is `probabilities` for every input (only the head's bias is non-zero)."""
    mlp = BlockSizeMLP(info.input_width, len(info.candidates), hidden=8, dropout=0.0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp.head.bias.copy_(torch.tensor(probabilities).log())
    export_predictor(mlp, path, info.to_metadata(), torch.randn(3, info.input_width))
    return path


@pytest.fixture(scope="module")
def confident_predictor(models):
    """Prefers block size 10 with probability 0.9 (block size 8 gets 0.04)."""
    tmp, target, drafter = models
    return _constant_predictor(tmp / "confident.onnx", _info(target, drafter), [0.02, 0.02, 0.04, 0.02, 0.9])


def _with_metadata(source, dest, **changes):
    """Copy of the ONNX file `source` with some metadata_props replaced."""
    import onnx

    proto = onnx.load(str(source))
    props = {p.key: p.value for p in proto.metadata_props}
    del proto.metadata_props[:]
    for key, value in {**props, **changes}.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(dest))
    return dest


def test_pooled_features_are_the_prompt_mean_and_logit_features_the_last_logits():
    hidden = torch.arange(24, dtype=torch.float32).reshape(1, 3, 8)
    logits = torch.randn(1, 11)
    assert torch.equal(prefill_features("pooled", hidden, logits), hidden[0].mean(0, keepdim=True))
    assert torch.equal(prefill_features("logits", hidden, logits), logits)
    with pytest.raises(ValueError):
        prefill_features("mean", hidden, logits)


def test_select_block_size_takes_the_top_candidate_or_falls_back_below_threshold():
    probs = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.6], [0.3, 0.25, 0.2, 0.15, 0.1], [0.0, 0.0, 1.0, 0.0, 0.0]])
    sizes, chosen = select_block_size(probs, torch.tensor(CANDIDATES), fallback=8, threshold=0.5)
    assert sizes.tolist() == [10, 8, 8]  # row 1: top probability 0.3 < 0.5 -> B_train
    assert chosen.tolist() == pytest.approx([0.6, 0.2, 1.0])  # the probability of the size actually chosen
    sizes, _ = select_block_size(probs, torch.tensor(CANDIDATES), fallback=8, threshold=0.0)
    assert sizes.tolist() == [10, 6, 8]
    sizes, chosen = select_block_size(probs, torch.tensor(CANDIDATES), fallback=16, threshold=0.7)
    assert sizes.tolist() == [16, 16, 8] and chosen.tolist()[:2] == [0.0, 0.0]  # fallback outside the classes


def test_runner_with_predictor_defaults_to_auto_and_reports_choice_probability_and_latency(models, confident_predictor):
    _, target, drafter = models
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=confident_predictor)
    out = runner.generate([torch.tensor(PROMPT)], max_new_tokens=24, end_id=-1, return_dict=True)
    assert out["block_sizes"] == [10]
    assert out["block_size_probs"][0] == pytest.approx(0.9, abs=1e-5)
    assert out["timings"][0]["predictor_s"] > 0
    assert max(out["accept_lengths"][0]) <= 10
    fixed = runner.generate([torch.tensor(PROMPT)], max_new_tokens=24, end_id=-1, block_size=10, return_dict=True)
    assert torch.equal(out["output_ids"], fixed["output_ids"]) and out["accept_lengths"] == fixed["accept_lengths"]
    explicit = runner.generate([torch.tensor(PROMPT)], max_new_tokens=8, end_id=-1, block_size=7, return_dict=True)
    assert explicit["block_sizes"] == [7] and explicit["block_size_probs"] == [None]


def test_auto_falls_back_to_b_train_when_the_predictor_is_unsure(models, confident_predictor):
    _, target, drafter = models
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=confident_predictor, predictor_threshold=0.95)
    out = runner.generate([torch.tensor(PROMPT)], max_new_tokens=8, end_id=-1, block_size="auto", return_dict=True)
    assert out["block_sizes"] == [8]
    assert out["block_size_probs"][0] == pytest.approx(0.04, abs=1e-5)


def test_auto_picks_the_size_the_onnx_predictor_scores_highest_for_the_prompt_features(models):
    tmp, target, drafter = models
    torch.manual_seed(3)
    mlp = BlockSizeMLP(32, len(CANDIDATES), hidden=16, dropout=0.0, mean=torch.randn(32), std=torch.rand(32) + 0.5)
    path = tmp / "random.onnx"
    export_predictor(mlp, path, _info(target, drafter).to_metadata(), torch.randn(4, 32))
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=path)
    for prompt in ([1, 2, 3], PROMPT, [90, 12, 12, 4, 77, 3, 41]):
        out = runner.generate([torch.tensor(prompt)], max_new_tokens=4, end_id=-1, return_dict=True)
        prefill = runner.backend.prefill(runner.backend.new_state(1, 16), torch.tensor([prompt]))
        with torch.no_grad():
            expected = torch.softmax(mlp.eval()(prefill.hidden.mean(1)), -1)[0]
        assert out["block_sizes"] == [CANDIDATES[int(expected.argmax())]]
        assert out["block_size_probs"][0] == pytest.approx(float(expected.max()), abs=1e-5)


def test_temperature_input_reaches_the_predictor(models):
    """A predictor that answers 6 at T = 0 and 10 at T = 1 (only the temperature input drives it)."""
    tmp, target, drafter = models
    mlp = BlockSizeMLP(32, len(CANDIDATES), hidden=4, dropout=0.0, with_temperature=True)
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp.fc1.weight[0, -1] = 1.0  # hidden unit 0 = relu(temperature)
        mlp.head.weight[4, 0] = 20.0  # block size 10 grows with temperature
        mlp.head.bias[0] = 10.0  # block size 6 wins at temperature 0
    path = tmp / "temperature.onnx"
    export_predictor(mlp, path, _info(target, drafter, with_temperature=True).to_metadata(), torch.randn(2, 32),
                     torch.tensor([[0.0], [1.0]]))
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=path)
    for temperature, expected in ((0.0, 6), (1.0, 10)):
        out = runner.generate([torch.tensor(PROMPT)], max_new_tokens=4, end_id=-1, temperature=temperature,
                              random_seed=0, return_dict=True)
        assert out["block_sizes"] == [expected]


def test_a_predictor_labelled_only_at_t0_leaves_sampled_requests_to_plain_decoding(models, confident_predictor):
    """No temperature input and labels made at T = 0 only: at T = 1 it does not choose (plain decoding);
    at T = 0, and for a predictor whose metadata names no temperatures, it does."""
    tmp, target, drafter = models
    t0_only = _with_metadata(confident_predictor, tmp / "t0.onnx", temperatures="[0.0]")
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=t0_only)
    for temperature, expected in ((0.0, 10), (0.03, 10), (1.0, 1)):
        out = runner.generate([torch.tensor(PROMPT)], max_new_tokens=4, end_id=-1, temperature=temperature,
                              random_seed=0, return_dict=True)
        assert out["block_sizes"] == [expected], temperature
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=confident_predictor)
    out = runner.generate([torch.tensor(PROMPT)], max_new_tokens=4, end_id=-1, temperature=1.0, random_seed=0,
                          return_dict=True)
    assert out["block_sizes"] == [10]


def test_predictor_trained_for_other_models_is_rejected(models, confident_predictor):
    tmp, target, drafter = models
    other = _with_metadata(confident_predictor, tmp / "other.onnx", target_sha256="0" * 64)
    with pytest.raises(UserError, match="another target"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=other)
    other = _with_metadata(confident_predictor, tmp / "other_drafter.onnx", drafter_sha256="0" * 64)
    with pytest.raises(UserError, match="another drafter"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=other)


def test_predictor_whose_width_or_classes_do_not_fit_the_runner_is_rejected(models, confident_predictor):
    tmp, target, drafter = models
    wide = _constant_predictor(tmp / "wide.onnx", _info(target, drafter, input_width=33), [0.2] * 5)
    with pytest.raises(UserError, match="33-wide pooled features but the target's hidden size is 32"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=wide)
    logits_kind = _with_metadata(confident_predictor, tmp / "logits.onnx", feature_kind="logits")
    with pytest.raises(UserError, match="vocabulary size is 97"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=logits_kind)
    too_big = _with_metadata(confident_predictor, tmp / "big.onnx", candidates=json.dumps([14, 15, 16, 17, 18]))
    with pytest.raises(UserError, match="block size 17"):  # the torch backend allows up to 2 x B_train = 16
        Runner.from_dir(target, drafter_dir=drafter, predictor=too_big)
    with pytest.raises(UserError, match="no drafter"):
        Runner.from_dir(target, predictor=confident_predictor)


def test_unreadable_or_foreign_predictor_files_are_user_errors(models, confident_predictor, tmp_path):
    with pytest.raises(UserError, match="not found"):
        OnnxBlockSizePolicy(tmp_path / "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not an onnx model")
    with pytest.raises(UserError, match="not a readable ONNX model"):
        OnnxBlockSizePolicy(garbage)
    foreign = _with_metadata(confident_predictor, tmp_path / "foreign.onnx", format="something-else")
    with pytest.raises(UserError, match="not a BlockPilot predictor"):
        OnnxBlockSizePolicy(foreign)
    with pytest.raises(UserError, match="not a probability"):
        OnnxBlockSizePolicy(confident_predictor, threshold=1.5)


def test_auto_choosing_block_size_1_decodes_plainly(models):
    tmp, target, drafter = models
    info = _info(target, drafter, candidates=(1, 8))
    plain_first = _constant_predictor(tmp / "plain.onnx", info, [0.9, 0.1])
    out = Runner.from_dir(target, drafter_dir=drafter, predictor=plain_first).generate(
        [torch.tensor(PROMPT)], max_new_tokens=6, end_id=-1, return_dict=True)
    plain = Runner.from_dir(target).generate([torch.tensor(PROMPT)], max_new_tokens=6, end_id=-1, return_dict=True)
    assert out["block_sizes"] == [1] and out["block_size_probs"][0] == pytest.approx(0.9, abs=1e-5)
    assert torch.equal(out["output_ids"], plain["output_ids"])
    assert set(out["accept_lengths"][0]) == {1}  # one token a step: plain decoding


def test_predictor_for_another_backend_or_dtype_is_refused_unless_overridden(models):
    tmp, target, drafter = models
    info = _info(target, drafter, objective="throughput", cost_backend="onnxruntime", cost_dtype="fp32",
                 cost_machine="AMD EPYC x2")
    path = _constant_predictor(tmp / "onnxruntime-fp32.onnx", info, [0.02, 0.02, 0.04, 0.02, 0.9])
    assert OnnxBlockSizePolicy(path).info.cost_machine == "AMD EPYC x2"
    with pytest.raises(UserError, match="labelled with onnxruntime fp32 step costs, this runner is torch fp32.*"
                                        "--predictor-any-backend"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=path)
    runner = Runner.from_dir(target, drafter_dir=drafter, predictor=path, predictor_any_backend=True)
    assert runner.generate([torch.tensor(PROMPT)], max_new_tokens=2, end_id=-1, return_dict=True)["block_sizes"] == [10]
    torch_fp32 = _constant_predictor(tmp / "torch-fp32.onnx", _info(
        target, drafter, objective="throughput", cost_backend="torch", cost_dtype="fp32"), [0.2] * 5)
    Runner.from_dir(target, drafter_dir=drafter, predictor=torch_fp32)  # its own backend and dtype: accepted
    with pytest.raises(UserError, match="torch fp32 step costs, this runner is torch bf16"):
        Runner.from_dir(target, drafter_dir=drafter, predictor=torch_fp32, dtype=torch.bfloat16,
                        max_block_size=10)  # bf16 takes blocks up to B_train (8) unless told; candidates reach 10
