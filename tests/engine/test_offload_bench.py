"""The MoE bench's tools (CPU): bench/offload_merge.py (a run's decode rows replace the file's, the
file then carries that run's label, and the targets, the A/B ratios and the repeat row's noise band
among them (fills behind the CPU over (d)), come from the new rows alone), gpu_offload's row order (the A/B sides alternate) and
split_policy_sim's fill-behind rule (idle PCIe time caches a CPU-computed miss, no call slower)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_offload  # noqa: E402
import offload_merge  # noqa: E402


def _row(policy: str, tok_s: float, budget: float = 32.0, batch: int = 1) -> dict:
    return {"model": "qwen3-30b-a3b", "routing": "locality", "batch": batch, "budget_gib": budget,
            "policy": policy, "tok_s": tok_s, "bound_tok_s": 100.0, "fraction_of_bound": tok_s / 100.0,
            "seconds_per_step": batch / tok_s, "miss_rate": 0.3, "fills_per_step": 10.0,
            "cpu_experts_per_step": 20.0}


def test_targets_give_each_ab_ratio_and_the_repeat_rows_noise_band():
    rows = [_row("static/graph", 50.0), _row("lru+q*", 90.0), _row("lru+q*/flat", 80.0),
            _row("lru+q*/again", 100.0), _row("lru+q*", 88.0, batch=4), _row("lru+q*/again", 80.0, batch=4)]
    t = offload_merge.targets(rows)
    assert t["decode_speed_curve_vs_flat"] == {"qwen3-30b-a3b locality b1 32GB": 1.125}
    assert t["decode_repeat_vs_first"] == {"qwen3-30b-a3b locality b1 32GB": 0.9,
                                           "qwen3-30b-a3b locality b4 32GB": 1.1}
    assert t["decode_repeat_vs_first_range"] == [0.9, 1.1]
    assert t["decode_lru_q_vs_static_32gb"] == {"qwen3-30b-a3b locality b1 32GB": 1.8}
    assert t["decode_rows_at_or_above_0.85"] == "2 of 2"


def test_targets_give_fills_behind_the_cpu_over_d_with_both_miss_rates():
    behind = {**_row("lru+q*/behind", 99.0), "miss_rate": 0.25}
    t = offload_merge.targets([_row("lru+q*", 90.0), behind, _row("lru+q*", 80.0, budget=8.0),
                               _row("lru+q*/behind", 80.0, budget=8.0)])
    assert t["decode_behind_over_lru_q"]["qwen3-30b-a3b locality b1 32GB"] == {
        "tok_s": 1.1, "miss_rate": [0.25, 0.3], "behind_fraction_of_bound": 0.99}
    assert t["decode_behind_over_lru_q_geomean"] == round(1.1 ** 0.5, 3)
    plans = gpu_offload.decode_plans(["lru+q*", "lru+q*/behind", "lru+q*/again"], [8.0, 16.0], 1, "locality")
    assert [p for p, _ in plans] == ["lru+q*", "lru+q*/behind", "lru+q*/again",
                                     "lru+q*/behind", "lru+q*", "lru+q*/again"]


def test_a_run_without_repeat_rows_reports_no_noise_band():
    t = offload_merge.targets([_row("lru+q*", 90.0), _row("lru+q*/flat", 80.0)])
    assert t["decode_repeat_vs_first"] == {} and "decode_repeat_vs_first_range" not in t


def _merge(tmp_path, base: dict, run: dict, label: str, previous: str, note: str) -> subprocess.CompletedProcess:
    """offload_merge.py run on a result file ``base`` and one run file ``run`` (written to tmp_path)."""
    result, part = tmp_path / "merged.json", tmp_path / "run.json"
    result.write_text(json.dumps(base))
    part.write_text(json.dumps(run))
    return subprocess.run([sys.executable, str(BENCH / "offload_merge.py"), "--result", str(result), "--label", label,
                           "--previous", previous, "--note", note, str(part)], capture_output=True, text=True)


def test_the_merged_file_takes_the_new_runs_label_and_keeps_the_old_rows(tmp_path):
    pytest.importorskip("matplotlib")
    base = {"label": "old run", "decode": [_row("lru+q*", 70.0)], "prefill": [], "bandwidth": {}, "started": "t0",
            "targets": {"prefill_8k": {"kept": True}}}
    run = {"decode": [_row("lru+q*", 90.0), _row("lru+q*/again", 90.0)], "started": "t1",
           "bandwidth": {"qwen3-30b-a3b": {}}, "hardware": {"gpu": "test GPU", "cpu": "test CPU"}, "cpu_expert_features": {},
           "method": "m"}
    p = _merge(tmp_path, base, run, "new run", "old run", "what it was")
    assert p.returncode == 0, p.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["label"] == "new run" and merged["runs"]["new run"] == "what it was"
    assert [r["tok_s"] for r in merged["decode_split_runs"]["old run"]["rows"]] == [70.0]
    assert [r["tok_s"] for r in merged["decode"]] == [90.0, 90.0]
    assert merged["targets"]["decode_repeat_vs_first_range"] == [1.0, 1.0]
    assert merged["targets"]["prefill_8k"] == {"kept": True}


def _prefill(model: str, seconds: float, tokens: int = 8192, mode: str = "double") -> dict:
    return {"model": model, "tokens": tokens, "mode": mode, "seconds": seconds, "bound_seconds": 1.0,
            "tok_s": tokens / seconds, "fraction_of_bound": 1.0 / seconds}


@pytest.mark.parametrize("slow, met", [(1.09, True), (1.11, False)])
def test_a_prefill_run_replaces_the_prefill_rows_and_its_target_and_keeps_the_decode(tmp_path, slow, met):
    pytest.importorskip("matplotlib")
    base = {"label": "R", "decode": [_row("lru+q*", 70.0)], "prefill": [{**_prefill("qwen3-30b-a3b", 1.0), "run": "Q"}],
            "bandwidth": {"qwen3-30b-a3b": {}}, "started": "t0", "runs": {"R": "decode"}, "hardware": {"gpu": "H200", "cpu": "Xeon"},
            "targets": {"prefill_8k": {"met": True, "rows": {}}}}
    rows = [_prefill("qwen3-30b-a3b", 0.95), _prefill("qwen3-30b-a3b", 1.5, mode="single"),
            _prefill("qwen3-30b-a3b", 3.0, tokens=16384), _prefill("qwen3.6-35b-a3b", slow)]
    run = {"decode": [], "prefill": rows, "started": "t1", "bandwidth": {"qwen3-30b-a3b": {}, "qwen3.6-35b-a3b": {}},
           "hardware": {"gpu": "test GPU", "cpu": "test CPU"}, "cpu_expert_features": {}, "method": "m"}
    p = _merge(tmp_path, base, run, "S", "Q", "prefill")
    assert p.returncode == 0, p.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [r["run"] for r in merged["prefill"]] == ["S"] * 4 and merged["prefill_split_runs"]["Q"]["rows"][0]["run"] == "Q"
    target = merged["targets"]["prefill_8k"]
    assert target["met"] is met                       # the 8k double-buffered chunk of every model within 10%
    assert target["rows"] == {"qwen3-30b-a3b": {"seconds": 0.95, "bound_seconds": 1.0},
                              "qwen3.6-35b-a3b": {"seconds": slow, "bound_seconds": 1.0}}
    assert merged["label"] == "R" and [r["tok_s"] for r in merged["decode"]] == [70.0]   # decode untouched
    assert merged["hardware"]["gpu"] == "H200" and merged["prefill_hardware"]["gpu"] == "test GPU"
    assert merged["prefill_split_runs"]["Q"]["hardware"]["gpu"] == "H200"
    assert merged["targets"]["decode_rows_at_or_above_0.85"] == "0 of 1"


def test_a_merge_of_runs_without_rows_is_one_line(tmp_path):
    p = _merge(tmp_path, {"label": "R", "decode": [], "prefill": []}, {"decode": [], "prefill": []}, "S", "R", "n")
    assert p.returncode == 1 and p.stderr.strip() == "offload_merge: the runs have no decode or prefill rows to merge"


def test_the_ab_sides_alternate_their_order_and_the_repeat_runs_after_them():
    policies = ["static/graph", "lru", "lru+q*", "lru+q*/flat", "lru+q*/again", "lru+q*/layer"]
    plans = gpu_offload.decode_plans(policies, [8.0, 16.0, 32.0], batch=1, routing="locality")
    by_budget = {b: [p for p, bb in plans if bb == b] for b in (8.0, 16.0, 32.0)}
    assert by_budget[8.0] == ["static/graph", "lru", "lru+q*", "lru+q*/flat", "lru+q*/again", "lru+q*/layer"]
    assert by_budget[16.0] == ["static/graph", "lru", "lru+q*/flat", "lru+q*", "lru+q*/again", "lru+q*/layer"]
    assert by_budget[32.0] == by_budget[8.0]
    flipped = gpu_offload.decode_plans(policies, [8.0], batch=1, routing="locality", flip=True)
    assert [p for p, _ in flipped][2:4] == ["lru+q*/flat", "lru+q*"]


def test_every_asked_side_runs_once_a_budget_and_the_layer_drivers_only_at_batch_1_locality():
    policies = ["all", "static", "lru", "lru+q*", "lru+q*@0.3+s", "lru+q*/plain", "lru+q*/layer", "lru+sync"]
    plans = gpu_offload.decode_plans(policies, [8.0, 32.0], batch=1, routing="locality")
    assert plans[0] == ("all", None)
    assert sorted(p for p, b in plans if b == 32.0) == sorted(policies[1:])
    uniform = gpu_offload.decode_plans(policies, [8.0, 32.0], batch=1, routing="uniform")
    assert not {p for p, _ in uniform} & {"lru+q*/layer", "lru+sync"}
    assert len(gpu_offload.decode_plans(["lru+q*"], [8.0, 16.0], batch=4, routing="uniform")) == 2


def test_fill_behind_caches_a_cpu_computed_miss_from_idle_pcie_time_without_slowing_a_call():
    import split_policy_sim
    seq = [(0, [7])] * 10                      # one layer; expert 7 misses each call, the CPU is faster
    kw = dict(slots=16, layers=1, f=0.3, t_fill=1.0, t_cpu=0.5, counted_from=0)
    base = split_policy_sim.simulate(seq, rule="recurring-first", **kw)
    behind = split_policy_sim.simulate(seq, rule="fill-behind", **kw)
    assert base["misses"] == 10 and base["fills"] == 0          # q* sends a lone miss to the CPU
    assert behind["behind"] == 1 and behind["misses"] == 2      # two calls' idle PCIe copied it
    assert behind["seconds"] == 2 * 0.5 and base["seconds"] == 10 * 0.5


def test_the_simulated_cpu_side_takes_the_call_size_curve_as_the_engines_rule_does():
    import split_policy_sim
    kw = dict(slots=16, layers=1, f=0.3, t_fill=1.0, t_cpu=0.5, rule="recurring-first", counted_from=0)
    flat = split_policy_sim.simulate([(0, [1, 2])], **kw)
    curve = split_policy_sim.simulate([(0, [1, 2])], speed=(1.0, 2.0), **kw)
    assert flat["cpu"] == curve["cpu"] == 2 and flat["fills"] == curve["fills"] == 0
    assert flat["seconds"] == 1.0 and curve["seconds"] == 0.5     # a 2-expert call at twice the rate
