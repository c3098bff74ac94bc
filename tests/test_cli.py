"""The `mhmoe` command, run as a user would: in a subprocess."""

import json
import os
import re
import subprocess
import sys

import pytest

ENV = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def mhmoe(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "mhmoe", *args], capture_output=True, text=True,
                          env=ENV, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"mhmoe {args} exited {proc.returncode}:\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


def test_demo_prints_its_table():
    out = mhmoe("demo", "--tokens", "48", "--experts", "2", "--runs", "1").stdout
    for field in ("device", "path", "tokens", "time", "TFLOP/s", "rel. error"):
        assert field in out, out
    err = float(re.search(r"rel\. error\s*\S\s*([0-9.e+-]+)", out).group(1))
    assert 1e-4 < err < 2e-2, out  # bf16 operands: 1e-3..1e-2 against float64
    assert "12 heads x 2 experts" in out and "48 (bf16)" in out


def test_demo_deterministic_flag():
    out = mhmoe("demo", "--tokens", "8", "--experts", "2", "--runs", "1",
                "--deterministic").stdout
    assert "(deterministic)" in out


def test_bench_writes_json_and_png(tmp_path):
    out_json = tmp_path / "bench.json"
    out = mhmoe("bench", "--tokens", "8,16", "--experts", "2", "--runs", "1", "--out",
                str(out_json)).stdout
    assert "route+CSR ms" in out
    data = json.loads(out_json.read_text())
    assert {r["tokens"] for r in data["rows"]} == {8, 16}
    for row in data["rows"]:
        assert row["path"] == "torch" and row["experts_ms"] > 0 and row["tflops"] > 0
        assert row["rel_err"] < 2e-2
    assert data["environment"]["torch"] and data["config"]["num_experts"] == 2
    png = out_json.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bad_arguments_fail_clearly():
    proc = mhmoe("demo", "--backend", "warp-drive", "--experts", "2", "--tokens", "4",
                 check=False)
    assert proc.returncode == 2 and "backend" in proc.stdout
    proc = mhmoe("frobnicate", check=False)
    assert proc.returncode == 2


@pytest.mark.parametrize("entry", [["-m", "mhmoe"], ["-c", "from mhmoe.cli import main; main()"]])
def test_help(entry):
    proc = subprocess.run([sys.executable, *entry, "--help"], capture_output=True, text=True,
                          env=ENV)
    assert proc.returncode == 0
    for command in ("demo", "bench", "inspect", "make-checkpoint"):
        assert command in proc.stdout


def test_demo_nproc_runs_head_parallel_and_checks():
    # 3 gloo processes, uneven tokens (the last rank gets none)
    out = mhmoe("demo", "--nproc", "3", "--experts", "2", "--tokens", "40", "--runs", "1").stdout
    assert "head-parallel layer over gloo" in out
    assert re.search(r"largest difference from the one-process layer: \S+ .*\(ok\)", out), out
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d\W+\d+\W+\d\W", line)]
    assert len(rows) == 3, out


def test_make_checkpoint_inspect_demo_and_a_corrupt_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = mhmoe("make-checkpoint", str(ckpt), "--layers", "2,3", "--experts", "2",
                "--shard-mb", "12").stdout
    assert "wrote" in out and "[2, 3]" in out
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").exists()

    out = mhmoe("inspect", str(ckpt)).stdout
    assert "no problems found" in out and "2 MoE layers" in out
    for shape in ("24x256", "24x256x1280", "24x1280x256"):
        assert shape in out

    out = mhmoe("demo", "--checkpoint", str(ckpt), "--layer", "3", "--tokens", "16",
                "--runs", "1").stdout
    assert f"{ckpt} layer 3" in out and "12 heads x 2 experts" in out
    err = float(re.search(r"rel\. error\s*\S\s*([0-9.e+-]+)", out).group(1))
    assert err < 2e-2

    # Cut the shard holding layer 3's W_down: inspect and demo both refuse, naming it.
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    victim = ckpt / index["weight_map"]["block.layers.3.mlp.moe_mlp.W_down"]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    proc = mhmoe("inspect", str(ckpt), check=False)
    assert proc.returncode == 1 and victim.name in proc.stdout and "problem" in proc.stdout
    proc = mhmoe("demo", "--checkpoint", str(ckpt), "--layer", "3", "--tokens", "4", check=False)
    assert proc.returncode == 2 and victim.name in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    proc = mhmoe("demo", "--checkpoint", str(ckpt), "--layer", "7", "--tokens", "4", check=False)
    assert proc.returncode == 2 and "block.layers.7" in proc.stdout


def test_inspect_of_a_missing_path():
    proc = mhmoe("inspect", "/nonexistent/ckpt", check=False)
    assert proc.returncode == 1 and "/nonexistent/ckpt" in proc.stdout


def test_demo_train_loss_falls():
    out = mhmoe("demo", "--train", "--steps", "12").stdout
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.8 * first and "ok" in out, out


def test_bench_without_matplotlib_still_writes_json(tmp_path):
    out_json = tmp_path / "b.json"
    code = ("import sys; sys.modules['matplotlib'] = None; from mhmoe.cli import main; "
            f"raise SystemExit(main(['bench', '--tokens', '4', '--experts', '2', '--runs', '1', "
            f"'--out', {str(out_json)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matplotlib is not installed" in proc.stdout and "Traceback" not in proc.stderr
    assert json.loads(out_json.read_text())["rows"]
