"""The timing harness: medians, FLOP counts, result files and plots."""

import json

import pytest
import torch

import mhmoe
from mhmoe.bench import (
    BenchRow,
    expert_tflops,
    plot_results,
    rel_err,
    script_command,
    tensor_bytes,
    time_fn,
    write_results,
)


def test_time_fn_median_and_repeats():
    calls = []
    timing = time_fn(lambda: calls.append(1), warmup=2, runs=5)
    assert len(calls) == 7 and timing.runs == 5
    assert 0 <= timing.min_ms <= timing.median_ms <= timing.max_ms


def test_rel_err_and_tensor_bytes_by_hand():
    # out - ref = (0, 4) and ||ref|| = 3: 4/3
    ref = torch.tensor([3.0, 0.0])
    assert rel_err(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), ref) == pytest.approx(4 / 3)
    assert rel_err(ref, ref) == 0.0
    assert rel_err(torch.empty(0), torch.empty(0)) == 0.0
    assert tensor_bytes([torch.zeros(3, 2, dtype=torch.bfloat16), torch.zeros(5)]) == 12 + 20


def test_script_command_reruns_the_same_arguments():
    # a sweep's variant list holds ';' and a shell would cut the line there unquoted
    import shlex

    argv = ["--sizes", "4096", "--sweep", "pdx=64/8/4,ws=1;panel=128/256/64/8/3", "--a b"]
    line = script_command("bench_expert_backward.py", argv)
    assert line.startswith("PYTHONPATH=src python3 benchmarks/bench_expert_backward.py ")
    assert shlex.split(line)[3:] == argv


def test_expert_tflops_by_hand():
    # MAGI-2: 141,557,760 FLOP per token; 1,000 tokens in 1 ms -> 141.56 TFLOP/s
    assert expert_tflops(mhmoe.MAGI2_PREVIEW, 1000, 1.0) == pytest.approx(141.55776)


def test_write_results_and_plot(tmp_path):
    rows = [BenchRow("torch", t, 0.1, 1.0 * t, 1.2 * t, 0.5, 1e-3) for t in (8, 16)]
    out = tmp_path / "r" / "bench.json"
    env = {"device": "test"}
    write_results(out, config=mhmoe.MAGI2_PREVIEW, env=env, rows=rows, peaks={})
    data = json.loads(out.read_text())
    assert data["environment"] == env and [r["tokens"] for r in data["rows"]] == [8, 16]
    assert data["config"]["route_scale"] == 4.9
    assert not list(out.parent.glob("*.tmp"))  # written atomically
    png = tmp_path / "r" / "bench.png"
    plot_results(png, rows=rows, peaks={"matmul_tflops": 700.0}, title="test")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("routing", ["uniform", "skewed", "hot", "hot-last"])
def test_expert_backward_benchmark_routings(routing, monkeypatch):
    # bench_expert_backward.py --routing: the share of the routes the favoured experts take,
    # counted here from the top-K picks of its scores.
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_expert_backward as beb

    st = beb.Setup(H=2, E=16, K=2, D=16, I=16, device="cpu", routing=routing)
    S = 2000
    picks = beb.route_scores(st, S, torch.Generator().manual_seed(3)).topk(st.K, -1).indices
    counts = torch.bincount(picks.flatten(), minlength=st.E).double() / picks.numel()
    if routing.startswith("hot"):
        hot = 0 if routing == "hot" else st.E - 1
        assert (picks == hot).any(-1).all()  # in every token's picks, each head
        assert counts[hot] == pytest.approx(1 / st.K)
    elif routing == "skewed":
        favoured = torch.randperm(st.E, generator=torch.Generator().manual_seed(0))[:st.E // 4]
        assert counts[favoured].sum().item() == pytest.approx(0.5, abs=0.01)
    else:
        assert counts.max().item() < 1.5 / st.E and counts.min().item() > 0.5 / st.E


def test_expert_backward_sweep_specs_refused_before_any_timing(monkeypatch):
    # bench_expert_backward.py --sweep: a variant given twice, or named "default", would
    # collide with another's name in the interleaved timing after every size was timed
    # (on a GPU); it is refused when the arguments are read, as is a part that is not
    # key=value.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import bench_expert_backward as beb

    assert beb.sweep_specs(" rcp=1 ;; dx=64/32/4/3, st=8;") == ["rcp=1", "dx=64/32/4/3,st=8"]
    assert beb.sweep_specs("") == []
    for bad, what in (("rcp=1;st=8;rcp=1", "named .rcp=1."),
                      ("rcp=1,st=8;rcp=1, st=8", "two variants"), ("default", "always timed"),
                      ("rcp", "not key=value"),
                      ("rcp=1,st", "not key=value"), ("rcp=1=0", "not key=value"),
                      ("=1", "not key=value"), ("rcp=", "not key=value")):
        with pytest.raises(ValueError, match=what):
            beb.sweep_specs(bad)
    # The script itself stops at its arguments (exit status 2), before it prints anything.
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_expert_backward.py"),
                           "--cpu", "--no-record", "--sweep", "rcp=1;rcp=1"],
                          capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert done.returncode == 2 and "two variants" in done.stderr, done.stderr[-500:]
    assert done.stdout == "", done.stdout[-500:]


def test_check_unique_and_the_fp8_benchmark_names(monkeypatch):
    # mhmoe.bench.check_unique names the first repeat; bench_expert_fp8.py's variants
    # would otherwise collide in a dict (--gluon rcp beside --reciprocals' copy of "ws"
    # was timed under one label).
    from pathlib import Path

    from mhmoe.bench import check_unique
    from mhmoe.kernels.tuning import Fp8ForwardConfig

    check_unique(["a", "b", "c"], "--x")
    with pytest.raises(ValueError, match="--x: two variants are named 'b'"):
        check_unique(iter(["a", "b", "c", "b"]), "--x")

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_expert_fp8 as bf

    table = Fp8ForwardConfig(64, 64, 4, 3)
    gluon = [("rcp,chk", bf.parse_gluon("rcp,chk"))]
    tiles = [bf.parse_tiles("64/64/8/2")]
    names = bf.fp8_variants(table, True, gluon, tiles, True, True)
    assert list(names) == ["default", "ws", "ws skip", "ws rcp,chk", "64/64/8/2",
                           "default rcp", "ws rcp", "ws skip rcp", "ws rcp,chk rcp",
                           "64/64/8/2 rcp"]
    assert names["ws skip rcp"].reciprocals and names["ws skip rcp"].skip_empty_halves
    assert names["ws rcp,chk"].chunked_x and not names["ws"].reciprocals
    # Off sm_90 the Gluon variants drop out; --gluon-only keeps the sets alone.
    assert list(bf.fp8_variants(table, False, gluon, tiles, True, False)) == [
        "default", "64/64/8/2"]
    assert list(bf.fp8_variants(None, True, gluon, [], False, False)) == ["ws rcp,chk"]
    with pytest.raises(ValueError, match="'ws rcp'"):
        bf.fp8_variants(table, True, [("rcp", bf.parse_gluon("rcp"))], [], False, True)
    with pytest.raises(ValueError, match="'64/64/8/2'"):
        bf.fp8_variants(table, True, [], tiles * 2, False, False)
    # The scripts stop at their arguments (exit status 2), before they print anything.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for script, args in (("bench_expert_forward.py", ["--cpu", "--sweep", "64/32/4/4;64/32/4/4"]),
                         ("bench_expert_fp8.py", ["--gluon", "rcp", "--reciprocals"])):
        done = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--no-record",
                               *args], capture_output=True, text=True, timeout=120, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root / "src")})
        assert done.returncode == 2 and "two variants are named" in done.stderr, \
            (script, done.stderr[-500:])
        assert done.stdout == "", (script, done.stdout[-500:])
