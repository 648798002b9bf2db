"""Predictor training: a separable dataset is learnt, the ONNX export matches torch, the report is right."""

import json

import pytest
import torch

from blockpilot import cli
from blockpilot.predictor.export import export_predictor, onnx_torch_difference
from blockpilot.predictor.labels import (
    LABEL_FORMAT,
    LABEL_VERSION,
    load_label_dataset,
    save_rows_atomic,
    write_json_atomic,
)
from blockpilot.predictor.model import BlockSizeMLP, ProbabilityModel
from blockpilot.predictor.report import report_paths
from blockpilot.predictor.train import TrainSettings, train_predictor
from blockpilot.runtime.policy import OnnxBlockSizePolicy

CANDIDATES = (6, 7, 8, 9, 10)
FAST = dict(hidden=32, max_epochs=80, patience=15)


def write_dataset(path, n=240, width=16, seed=0, temperature=0.0, classes=None, target_sha="t" * 64,
                  feature_classes=None):
    """A label dataset whose best block size is a function of well-separated feature clusters
    (the clusters of `feature_classes`, default: the rows' classes).

    tau falls by 0.5 per step away from the row's class; candidate k costs (1 + 0.05 k) s a step.
    Returns the rows' classes.
    """
    g = torch.Generator().manual_seed(seed)
    k = len(CANDIDATES)
    cls = torch.randint(0, k, (n,), generator=g) if classes is None else classes
    centers = torch.randn(k, width, generator=torch.Generator().manual_seed(99)) * 3
    pooled = centers[cls if feature_classes is None else feature_classes] + torch.randn(n, width, generator=g)
    tau = 4.0 - 0.5 * (torch.arange(k)[None] - cls[:, None]).abs().double()
    steps = torch.full((n, k), 10, dtype=torch.int64)
    step_cost = 1 + 0.05 * torch.arange(k, dtype=torch.float64)
    rows = {"pooled": pooled, "logits": torch.randn(n, 20, generator=g), "tau": tau, "steps": steps,
            "accepted": (tau * 10).long(), "new_tokens": (tau * 10).long(),
            "draft_s": (0.2 * step_cost * 10).expand(n, k).clone(),
            "verify_s": (0.8 * step_cost * 10).expand(n, k).clone(),
            "step_s": step_cost.expand(n, k).clone(), "prompt_tokens": torch.full((n,), 12, dtype=torch.int64)}
    meta = {"format": LABEL_FORMAT, "version": LABEL_VERSION, "target_sha256": target_sha, "drafter_sha256": "d" * 64,
            "candidates": list(CANDIDATES), "b_train": 8, "temperature": temperature}
    write_json_atomic(meta, path / "meta.json")
    save_rows_atomic([f"p{i}" for i in range(n)], rows, path / "labels.safetensors")
    return cls


def test_training_on_separable_features_reaches_high_test_accuracy_and_oracle_tau(tmp_path):
    classes = write_dataset(tmp_path / "ds")
    dataset = load_label_dataset(tmp_path / "ds")
    assert torch.equal(dataset.labels("tau"), classes)
    report = train_predictor([dataset], TrainSettings(**FAST), tmp_path / "p.onnx")
    test = report["splits"]["test"]
    assert report["evaluated_on"] == "test" and report["split_rows"] == {"train": 168, "val": 36, "test": 36}
    assert test["accuracy"] > 0.95
    confusion = test["confusion"]
    assert sum(map(sum, confusion)) == 36 and sum(confusion[i][i] for i in range(5)) == round(36 * test["accuracy"])
    assert test["tau"]["auto"] > test["tau"]["best_fixed"] and test["tau"]["regret"] < 0.05
    test_rows = report_rows(report, "test", 240)
    assert test["tau"]["fixed"]["8"] == pytest.approx(float(dataset.rows["tau"][test_rows][:, 2].mean()))
    json_path, md_path = report_paths(tmp_path / "p.onnx")
    assert json.loads(json_path.read_text())["splits"]["test"]["accuracy"] == test["accuracy"]
    assert "| **auto** |" in md_path.read_text()


def report_rows(report, split, n):
    """The row indices of `split`, recomputed with the same seeded split."""
    from blockpilot.predictor.train import split_indices

    s = report["settings"]
    train, val, test = split_indices(n, s["val_fraction"], s["test_fraction"], s["seed"])
    return {"train": train, "val": val, "test": test}[split]


def test_onnx_export_passes_the_checker_and_matches_torch_within_1e_5(tmp_path):
    import onnx

    torch.manual_seed(0)
    mlp = BlockSizeMLP(24, 5, hidden=64, mean=torch.randn(24), std=torch.rand(24) + 0.1)
    path = tmp_path / "m.onnx"
    metadata = {"format": "blockpilot-predictor", "candidates": "[1]"}
    assert export_predictor(mlp, path, metadata, torch.randn(8, 24)) <= 1e-5
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["features"]
    assert [o.name for o in model.graph.output] == ["probabilities"]
    assert {p.key: p.value for p in model.metadata_props}["candidates"] == "[1]"
    fresh = torch.randn(37, 24) * 5  # another batch size than at export
    assert onnx_torch_difference(path, ProbabilityModel(mlp), fresh) <= 1e-5


def test_train_predictor_cli_stores_candidates_kind_width_objective_and_hashes(tmp_path, capsys):
    write_dataset(tmp_path / "ds")
    out = tmp_path / "pred.onnx"
    assert cli.main(["train-predictor", "--dataset", str(tmp_path / "ds"), "--out", str(out), "--objective",
                     "throughput", "--hidden", "32", "--max-epochs", "40", "--threshold", "0.3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["accuracy"] > 0.9
    info = OnnxBlockSizePolicy(out).info
    assert info.candidates == CANDIDATES and info.feature_kind == "pooled" and info.input_width == 16
    assert info.objective == "throughput" and info.target_sha256 == "t" * 64 and info.threshold == 0.3
    assert not info.with_temperature


def test_temperature_input_lets_one_predictor_serve_two_temperatures(tmp_path):
    """Same features at both temperatures; the label is 6 at T = 0 and 10 at T = 1."""
    n = 120
    same = torch.full((n,), 2)
    write_dataset(tmp_path / "t0", n=n, seed=1, temperature=0.0, classes=torch.zeros(n, dtype=torch.int64),
                  feature_classes=same)
    write_dataset(tmp_path / "t1", n=n, seed=1, temperature=1.0, classes=torch.full((n,), 4), feature_classes=same)
    datasets = [load_label_dataset(tmp_path / "t0"), load_label_dataset(tmp_path / "t1")]
    out = tmp_path / "t.onnx"
    # identical features with opposite labels: only the temperature column separates them, which takes epochs
    report = train_predictor(datasets, TrainSettings(with_temperature=True, hidden=32, max_epochs=300), out)
    assert report["splits"]["test"]["accuracy"] > 0.95
    policy = OnnxBlockSizePolicy(out)
    features = datasets[0].rows["pooled"][:4]
    assert policy.probabilities(features, temperature=0.0).argmax(1).tolist() == [0] * 4
    assert policy.probabilities(features, temperature=1.0).argmax(1).tolist() == [4] * 4


def test_temperature_heads_keep_greedy_and_sampled_outputs_apart():
    """With two heads, a greedy request's output depends only on the greedy head and a T >= 1 one only on
    the sampled head."""
    torch.manual_seed(0)
    mlp = BlockSizeMLP(8, 5, hidden=16, dropout=0.0, with_temperature=True, temperature_heads=True).eval()
    x = torch.randn(3, 8)
    cold, hot = (mlp(x, torch.full((3, 1), t)) for t in (0.0, 1.0))
    with torch.no_grad():
        mlp.head.weight.add_(1.0)
    assert torch.equal(mlp(x, torch.ones(3, 1)), hot)
    assert not torch.allclose(mlp(x, torch.zeros(3, 1)), cold)
    with torch.no_grad():
        mlp.head.weight.sub_(1.0)
        mlp.head_sampled.weight.add_(1.0)
    assert torch.allclose(mlp(x, torch.zeros(3, 1)), cold)
    assert not torch.allclose(mlp(x, torch.ones(3, 1)), hot)
    with pytest.raises(ValueError):
        BlockSizeMLP(8, 5, temperature_heads=True)


def test_temperature_heads_learn_a_sampled_choice_that_the_greedy_labels_contradict(tmp_path):
    """Five prompt clusters, each best at its own size at T = 0; at T = 1 every prompt is best at 6. The
    predictor with temperature heads follows the greedy labels at T = 0 and the sampled ones at T = 1, and
    its report breaks the test split down by temperature."""
    n = 240
    clusters = torch.randint(0, len(CANDIDATES), (n,), generator=torch.Generator().manual_seed(3))
    write_dataset(tmp_path / "t0", n=n, seed=3, temperature=0.0, classes=clusters)
    write_dataset(tmp_path / "t1", n=n, seed=3, temperature=1.0, classes=torch.zeros(n, dtype=torch.int64),
                  feature_classes=clusters)
    datasets = [load_label_dataset(tmp_path / "t0"), load_label_dataset(tmp_path / "t1")]
    out = tmp_path / "heads.onnx"
    report = train_predictor(datasets, TrainSettings(with_temperature=True, temperature_heads=True, **FAST), out)
    by_t = report["splits"]["test"]["by_temperature"]
    assert set(by_t) == {"0", "1"}
    for t in ("0", "1"):
        assert by_t[t]["tau"]["auto"] == pytest.approx(by_t[t]["tau"]["oracle"], rel=0.02)
    assert report["metadata"]["temperature_heads"] == "true"
    policy = OnnxBlockSizePolicy(out)
    features = datasets[0].rows["pooled"][:40]
    assert (policy.probabilities(features, temperature=0.0).argmax(1) == clusters[:40]).double().mean() > 0.9
    assert policy.probabilities(features, temperature=1.0).argmax(1).tolist() == [0] * 40
    assert "auto at T = 1" in report_paths(out)[1].read_text()


def test_train_predictor_bad_inputs_end_in_one_line_and_exit_2(tmp_path, capsys):
    from fixtures import make_hf_target

    write_dataset(tmp_path / "a")
    write_dataset(tmp_path / "b", target_sha="0" * 64)
    write_dataset(tmp_path / "small", n=5)
    (tmp_path / "notes").mkdir()
    (tmp_path / "labels.jsonl").write_text('{"prompt": "a"}\n')  # a file where the dataset folder is wanted
    base = ["train-predictor", "--out", str(tmp_path / "p.onnx"), "--hidden", "8", "--max-epochs", "2"]
    target = make_hf_target(tmp_path, "llama")
    capsys.readouterr()  # saving the fixture model prints progress
    cases = [
        (["--dataset", str(tmp_path / "a"), "--dataset", str(tmp_path / "b")], "datasets differ in target_sha256"),
        (["--dataset", str(tmp_path / "a"), "--target", str(target)], "labelled with another target"),
        (["--dataset", str(tmp_path / "small")], "has 5 labelled prompts"),
        (["--dataset", str(tmp_path / "notes")], "is not a label dataset"),
        (["--dataset", str(tmp_path / "labels.jsonl")], "is a file, not a label dataset; pass the folder"),
        (["--dataset", str(tmp_path / "a"), "--val-fraction", "0.9"], "fractions must be"),
        (["--dataset", str(tmp_path / "a"), "--temperature-heads"], "--temperature-heads needs --with-temperature"),
        (["--dataset", str(tmp_path / "a"), "--lr", "-1"], "--lr must be > 0 and --weight-decay >= 0"),
        (["--dataset", str(tmp_path / "a"), "--weight-decay", "-0.1"], "--lr must be > 0 and --weight-decay >= 0"),
    ]
    for extra, message in cases:
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "p.onnx").exists()


def test_regret_loss_chooses_the_size_that_is_always_near_best_where_cross_entropy_chooses_the_majority(tmp_path):
    """One cluster of prompts: 60% are best at 6 (10 is poor there), 40% at 10 (6 is poor there); 8 is
    never the best but within 1% of it on every prompt. Cross-entropy learns the majority label (6:
    expected 80% of the oracle) or whichever label a prompt's feature noise recalls, never 8; the regret
    loss learns 8 (99%)."""
    n = 200
    write_dataset(tmp_path / "ds", n=n, feature_classes=torch.full((n,), 2))
    dataset = load_label_dataset(tmp_path / "ds")
    first = torch.arange(n) % 5 < 3  # 60%
    tau = torch.empty(n, len(CANDIDATES), dtype=torch.float64)
    tau[first] = torch.tensor([4.0, 3.0, 3.96, 3.0, 0.8], dtype=torch.float64)
    tau[~first] = torch.tensor([2.0, 3.0, 3.96, 3.0, 4.0], dtype=torch.float64)
    dataset.rows["tau"] = tau
    chosen = {}
    for loss in ("ce", "regret"):
        report = train_predictor([dataset], TrainSettings(loss=loss, **FAST), tmp_path / f"{loss}.onnx")
        policy = OnnxBlockSizePolicy(tmp_path / f"{loss}.onnx")
        chosen[loss] = set(policy.probabilities(dataset.rows["pooled"][:20]).argmax(1).tolist())
        assert {p.key: p.value for p in __import__("onnx").load(str(tmp_path / f"{loss}.onnx")).metadata_props}[
            "loss"] == loss
    assert CANDIDATES.index(8) not in chosen["ce"]
    assert chosen["regret"] == {CANDIDATES.index(8)}
    assert report["splits"]["test"]["tau"]["auto"] == pytest.approx(3.96)


def test_a_throughput_predictor_carries_its_step_costs_and_revises_blocks_with_them(tmp_path):
    from blockpilot.builder.manifest import StepCosts

    write_dataset(tmp_path / "ds")
    table = StepCosts("onnxruntime", "fp32", "test cpu", 256, {k: 10.0 + k for k in (1, *CANDIDATES)},
                      {k: 1.0 for k in CANDIDATES})
    dataset = load_label_dataset(tmp_path / "ds").with_step_costs(table)
    train_predictor([dataset], TrainSettings(objective="throughput", **FAST), tmp_path / "p.onnx")
    policy = OnnxBlockSizePolicy(tmp_path / "p.onnx")
    assert policy.step_costs == table
    assert policy.revise(10, [2] * 40, 40, lambda k: True) == 10  # off by default
    policy.revise_min_steps, policy.revise_margin = 4, 0.05
    # one draft accepted per step: every size commits 2 tokens, so the cheapest candidate (6) pays best
    assert policy.revise(10, [2] * 6, 6, lambda k: True) == 6
    assert policy.revise(10, [2] * 6, 6, lambda k: k != 6) == 7  # one the backend cannot run is skipped
    assert policy.revise(10, [2] * 6, 2, lambda k: True) == 10  # too few steps yet
    write_dataset(tmp_path / "tau")  # tau labels: no table, no revision
    train_predictor([load_label_dataset(tmp_path / "tau")], TrainSettings(**FAST), tmp_path / "t.onnx")
    tau_policy = OnnxBlockSizePolicy(tmp_path / "t.onnx")
    tau_policy.revise_min_steps = 4
    assert tau_policy.step_costs is None and tau_policy.revise(10, [2] * 6, 6, lambda k: True) == 10


def test_rows_of_one_prompt_at_several_temperatures_fall_in_the_same_split():
    from blockpilot.predictor.train import prompt_groups, split_indices

    features = torch.randn(40, 6)
    stacked = torch.cat((features, features[:25], features[10:30]))  # T = 0 rows, then two sampled datasets
    groups = prompt_groups(stacked)
    assert groups[:40].tolist() == list(range(40)) and torch.equal(groups[40:65], groups[:25])
    train, val, test = split_indices(len(stacked), 0.2, 0.2, 3, groups)
    assert sorted(torch.cat((train, val, test)).tolist()) == list(range(len(stacked)))
    sets = [set(groups[rows].tolist()) for rows in (train, val, test)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert (len(sets[1]), len(sets[2])) == (8, 8)  # fractions count prompts, not rows
    ungrouped = split_indices(40, 0.2, 0.2, 3)
    assert all(torch.equal(a, b) for a, b in zip(split_indices(40, 0.2, 0.2, 3, prompt_groups(features)), ungrouped))


def test_analysis_script_writes_the_test_split_prompts_of_the_named_dataset_only(tmp_path, capsys):
    from blockpilot.predictor.train import assemble, prompt_groups, split_indices

    from fixtures import load_script

    analysis = load_script("predictor_analysis")
    paths = []
    for name, seed in (("labels-a", 0), ("labels-b", 1)):
        path = tmp_path / name
        write_dataset(path, n=60, seed=seed)
        prompts = tmp_path / f"{name}.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"{name} prompt {i}", "source": "code"}) + "\n"
                                   for i in range(60)))
        meta = json.loads((path / "meta.json").read_text())
        write_json_atomic({**meta, "prompts_file": str(prompts)}, path / "meta.json")
        paths.append(path)
    out = tmp_path / "test.jsonl"
    argv = [a for p in paths for a in ("--dataset", str(p))] + ["--test-prompts", str(out), "--test-from", "labels-b"]
    assert analysis.main(argv) == 0
    data = assemble([load_label_dataset(p) for p in paths], TrainSettings(objective="throughput"))
    _, _, test = split_indices(len(data.labels), 0.15, 0.15, 0, prompt_groups(data.features))
    expected = [f"labels-b prompt {i - 60}" for i in sorted(test.tolist()) if i >= 60]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert expected and [w["prompt"] for w in written] == expected
    assert {w["dataset"] for w in written} == {"labels-b"} and {w["category"] for w in written} == {"code"}
    assert "test-split prompts" in capsys.readouterr().out
