"""`scripts/bench_steps.py` (the step-cost instrument) runs end to end on a tiny model."""

import json

from fixtures import load_script


def test_step_costs_of_every_path_are_measured_for_every_k_with_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "steps.json"
    code = load_script("bench_steps").main(["--tiny", "--k-max", "4", "--context", "12", "--repeats", "1",
                                            "--work", str(tmp_path), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    paths = {p["name"]: p for p in result["paths"]}
    assert set(paths) == {"torch-fp32", "torch-bf16", "onnxruntime-fp32"}
    for path in paths.values():
        assert sorted(int(k) for k in path["verify_ms"]) == [1, 2, 3, 4]
        assert sorted(int(k) for k in path["draft_ms"]) == [2, 3, 4]
        assert all(ms > 0 for ms in [*path["verify_ms"].values(), *path["draft_ms"].values()])
    assert paths["onnxruntime-fp32"]["one_row_ms"] > 0  # the padded plain step is measured beside the 1-row one
    assert result["floors"]["bandwidth_gb_s"] > 0 and result["floors"]["peak_gflop_s"]["bf16"] > 0
    table = capsys.readouterr().out
    assert "| onnxruntime-fp32 (draft + verify) / decode step | 1.00 |" in table
