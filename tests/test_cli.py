"""The `mhmoe` command, run as a user would, through its entry point `mhmoe.cli.main`.

Exit statuses (`mhmoe --help`): 0 ok, 1 a check failed, 2 usage or input error, 3 a
bug. Results go to stdout, errors to stderr as one line without a traceback.

Most runs are in this process (`mhmoe(...)`): a fresh Python costs 2.5-3 s of CPU to
import torch and triton, some 75 times here. `_run_in_process` gives `main` what a fresh
`python -m mhmoe` has where the command's output depends on it: stdout and stderr of its
own (rich's consoles are made anew for the run, on them), COLUMNS=200, the interpreter's
default warning filters with warnings printed on stderr, the library's warn-once flags
unset; and it puts them back after, so that a run leaks nothing into later tests (the
command sets no other global state: threads, signals and os.environ are touched only by
the launcher paths, which run in processes of their own; a run of `bench` that plots
leaves matplotlib on its Agg backend, which no test reads). The Triton interpreter is this
process's, as conftest.py sets it up for the library's own tests. What a process of its
own would show and this capture does not: output written below Python, straight to file
descriptors 1 and 2 (C++ logs, OpenMP), and torch's C++ warn-once warnings after their
first time in the worker; the command writes through Python only.

In a process of their own (`own_process=True`, or `subprocess.run` of their own): the
entry points themselves (`python -m mhmoe --help`), the checks that `--help` and usage
errors import no torch, `--nproc` and torchrun (they start processes, which write to
this process's file descriptors, and set OMP_NUM_THREADS and signal handlers), runs with
another environment (`env=`: a launcher's RANK / WORLD_SIZE, no TRITON_INTERPRET, which
triton reads once, at import), the out-of-memory run (a 1.2 TB allocation, kept away
from the test process), the unexpected-error test (a traceback of a real run), and
`bench` without matplotlib (missing before mhmoe is imported).
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from unittest import mock

import pytest

ENV = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
SRC = Path(__file__).resolve().parents[1] / "src"


def _cuda():
    import torch

    return torch.cuda.is_available()


def mhmoe(*args, check=True, env=None, own_process=False):
    """`mhmoe ARGS`, in this process (`_run_in_process`), or with own_process=True in a
    fresh `python -m mhmoe` (with `env`, default ENV). Returns a CompletedProcess."""
    if env is not None and not own_process:
        raise TypeError("env= is the environment of a process of its own: add own_process=True")
    if own_process:
        proc = subprocess.run([sys.executable, "-m", "mhmoe", *args], capture_output=True,
                              text=True, env=ENV if env is None else env, timeout=600)
    else:
        proc = _run_in_process(args)
    if check and proc.returncode != 0:
        raise AssertionError(f"mhmoe {args} exited {proc.returncode}:\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


@contextlib.contextmanager
def _fresh_warn_once_flags():
    """The library's warn-once flags as a fresh process has them (none warned yet), and
    as they were once the run is over."""
    from mhmoe import experts
    from mhmoe.kernels import expert_backward

    warned, recompute = set(experts._warned), expert_backward._warned_recompute
    experts._warned.clear()
    expert_backward._warned_recompute = False
    try:
        yield
    finally:
        experts._warned.clear()
        experts._warned.update(warned)
        expert_backward._warned_recompute = recompute


@contextlib.contextmanager
def _default_warnings():
    """The warning filters of a fresh interpreter (not pytest's), warnings printed on
    sys.stderr as Python prints them (pytest would record them instead)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning,
                         DeprecationWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module=r"__main__\Z")

        def show(message, category, filename, lineno, file=None, line=None):
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = show
        yield


def _run_in_process(args) -> subprocess.CompletedProcess:
    """`python -m mhmoe ARGS` (`raise SystemExit(main())`) in this process: its exit
    status as Python gives it (SystemExit's code, None being 0; an uncaught exception
    prints its traceback and exits 1), its stdout and stderr captured."""
    import rich

    from mhmoe import cli

    out, err = io.StringIO(), io.StringIO()
    # rich's consoles (mhmoe's, and rich's own, which the checkpoint progress bars use)
    # read COLUMNS and whether they write to a terminal when made: made in the run, on
    # out and err.
    with mock.patch.dict(os.environ, {"COLUMNS": "200"}), _fresh_warn_once_flags(), \
            mock.patch.object(rich, "_console", None), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), _default_warnings():
        cli._console.cache_clear()
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: --help, --version, usage errors
            code = e.code
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            cli._console.cache_clear()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    return subprocess.CompletedProcess(["mhmoe", *args], code, out.getvalue(), err.getvalue())


def one_error_line(proc, *words, status=2):
    """A failed run: `status`, nothing on stdout, one error line on stderr naming `words`
    (after argparse's usage line for usage errors)."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "", proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(line.startswith(("usage:", " ")) for line in lines if line not in errors), lines
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def make_checkpoint(path, *extra, check=True):
    return mhmoe("make-checkpoint", str(path), "--experts", "2", *extra, check=check)


def rewrite_safetensors(file, change):
    """Load a safetensors file, let `change(tensors, metadata)` edit it, write it back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    change(tensors, metadata)
    save_file(tensors, str(file), metadata=metadata)


def test_demo_prints_its_table():
    out = mhmoe("demo", "--tokens", "48", "--experts", "2", "--runs", "1").stdout
    for field in ("device", "path", "tokens", "time", "TFLOP/s", "rel. error"):
        assert field in out, out
    err = float(re.search(r"rel\. error\s*\S\s*([0-9.e+-]+)", out).group(1))
    assert 1e-4 < err < 2e-2, out  # bf16 operands: 1e-3..1e-2 against float64
    assert "12 heads x 2 experts" in out and "48 (bf16)" in out
    # the time of each call (on a GPU, said to hold the host's launches); the CUDA graph's
    # GPU time only on a GPU
    assert "ms (median of 1" in out and ("time (CUDA graph)" in out) == _cuda(), out
    assert ("the host's launches included" in out) == _cuda(), out


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
    one_error_line(mhmoe("demo", "--backend", "warp-drive", check=False), "--backend")
    one_error_line(mhmoe("frobnicate", check=False), "frobnicate")


@pytest.mark.parametrize("entry", [["-m", "mhmoe"], ["-c", "from mhmoe.cli import main; main()"]])
def test_help(entry):
    proc = subprocess.run([sys.executable, *entry, "--help"], capture_output=True, text=True,
                          env=ENV)
    assert proc.returncode == 0
    for command in ("demo", "bench", "inspect", "make-checkpoint"):
        assert command in proc.stdout
    # the exit-status convention, documented where users look
    assert "exit status" in proc.stdout and "2  usage or input error" in proc.stdout


def test_version_and_defaults_in_help():
    from importlib.metadata import version

    assert mhmoe("--version").stdout.strip() == f"mhmoe {version('mhmoe')}"
    demo = " ".join(mhmoe("demo", "--help").stdout.split())
    for shown in ("timed runs, the median reported (not with --train) (default: 3)",
                  "input dtype (one-process demos) (default: bf16)",
                  "(default: 256 on a GPU, 8 on the CPU)", "seed of weights and inputs "
                  "(default: 0)", "(default: 0.005)", "(default: 16)"):
        assert shown in demo, shown
    make = " ".join(mhmoe("make-checkpoint", "--help").stdout.split())
    assert "(default: 8)" in make and "(default: one file)" in make


def test_backend_choices_are_the_library_s():
    from mhmoe.backends import BACKENDS
    from mhmoe.cli import BACKEND_NAMES

    assert BACKEND_NAMES == BACKENDS


_NO_HEAVY_IMPORTS = """
import sys, types
# mhmoe/__init__ imports the library; the command module itself must not, before the
# arguments are parsed. A bare package object stands in for the package's __init__.
package = types.ModuleType("mhmoe")
package.__path__ = [sys.argv[1]]
sys.modules["mhmoe"] = package
from mhmoe.cli import main
for argv in (["--help"], ["--version"], ["demo", "--help"], ["make-checkpoint", "x",
             "--layers", "2,2"], ["demo", "--tokens", "0"], ["quantize", "--help"],
             ["quantize", "a", "b", "--layers", "x"], ["demo", "--fp8", "--layers", "37"]):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "triton", "rich", "numpy") if m in sys.modules)
print("heavy:", heavy, file=sys.stderr)
"""


def test_help_and_usage_errors_import_no_torch():
    proc = subprocess.run([sys.executable, "-c", _NO_HEAVY_IMPORTS, str(SRC / "mhmoe")],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert "heavy: []" in proc.stderr, proc.stderr


def test_mhmoe_help_imports_no_torch():
    code = ("import runpy, sys; sys.argv = ['mhmoe', '--help']\ntry:\n"
            "    runpy.run_module('mhmoe', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert proc.stderr.strip().endswith("False"), proc.stderr


def test_demo_nproc_runs_head_parallel_and_checks():
    # 3 gloo processes, uneven tokens (the last rank gets none)
    # its own process: the launcher's processes write to its stdout's file descriptor
    out = mhmoe("demo", "--nproc", "3", "--experts", "2", "--tokens", "40", "--runs", "1",
                own_process=True).stdout
    assert "head-parallel layer over gloo" in out
    assert re.search(r"largest difference from the one-process layer: \S+ .*\(ok\)", out), out
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d\W+\d+\W+\d\W", line)]
    assert len(rows) == 3, out


def test_torchrun_demo_runs_as_one_group():
    # torchrun --nproc-per-node 2 -m mhmoe demo ran two separate one-process demos; under
    # a launcher the command joins the launched group and rank 0 prints one table.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "mhmoe", "demo", "--experts", "2",
                           "--tokens", "24", "--runs", "1", "--deterministic"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "one multi-head MoE layer forward" not in out, out
    assert out.count("on 2 processes: head-parallel layer over gloo") == 1, out
    assert "deterministic" in out  # --deterministic is honoured by the group demo
    assert len(re.findall(r"largest difference from the one-process layer: \S+ .*\(ok\)",
                          out)) == 1, out
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d\W+\d+\W+\d\W", line)]
    assert [int(re.match(r"^\W*(\d)", row).group(1)) for row in rows] == [0, 1], out
    # Only the head-parallel demo runs as a group; the others are refused there.
    launched = {**ENV, "RANK": "0", "WORLD_SIZE": "2"}
    one_error_line(mhmoe("demo", "--train", check=False, env=launched, own_process=True),
                   "--train", "launcher")
    one_error_line(mhmoe("inspect", "x", check=False, env=launched, own_process=True),
                   "WORLD_SIZE=2")


def test_make_checkpoint_inspect_demo_and_a_corrupt_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = make_checkpoint(ckpt, "--layers", "2,3", "--shard-mb", "12").stdout
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
    one_error_line(proc, victim.name)
    proc = mhmoe("demo", "--checkpoint", str(ckpt), "--layer", "7", "--tokens", "4", check=False)
    one_error_line(proc, "block.layers.7")


def test_inspect_of_a_missing_path():
    one_error_line(mhmoe("inspect", "/nonexistent/ckpt", check=False), "/nonexistent/ckpt")


def test_make_checkpoint_never_deletes_another_model(tmp_path):
    # Data loss: make-checkpoint into a directory holding a model deleted its files.
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(4)}, str(model / "model-00001-of-00002.safetensors"))
    save_file({"v": torch.ones(4)}, str(model / "model-00002-of-00002.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                                        "v": "model-00002-of-00002.safetensors"}}))
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    proc = mhmoe("make-checkpoint", str(model), "--experts", "2", check=False)
    one_error_line(proc, "already holds a checkpoint", "--overwrite")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    # --overwrite with one file would leave the other model's index beside it: refused.
    one_error_line(make_checkpoint(model, "--overwrite", check=False), "not written by mhmoe")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    # Sharded, it replaces the index (asked for) and keeps the shards it does not reuse.
    out = make_checkpoint(model, "--overwrite", "--shard-mb", "12").stdout
    assert "wrote 6 file(s)" in out
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (model / name).read_bytes() == before[name]
    assert "no problems found" in mhmoe("inspect", str(model)).stdout


def test_inspect_checks_finiteness_by_default(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt)

    def plant_nan(tensors, metadata):
        tensors["block.layers.2.mlp.moe_mlp.W_up"][5, 7, 9] = float("nan")

    rewrite_safetensors(ckpt / "model.safetensors", plant_nan)
    proc = mhmoe("inspect", str(ckpt), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "non-finite" in proc.stdout and "block.layers.2.mlp.moe_mlp.W_up" in proc.stdout
    assert "no problems found" not in proc.stdout
    out = mhmoe("inspect", str(ckpt), "--no-finite-check").stdout
    assert "no problems found" in out and "not checked for NaN" in out


def test_demo_config_for_a_checkpoint_without_metadata(tmp_path):
    from mhmoe import MAGI2_PREVIEW

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt)
    rewrite_safetensors(ckpt / "model.safetensors",
                        lambda tensors, metadata: metadata.clear())  # a release checkpoint
    run = ("demo", "--checkpoint", str(ckpt), "--tokens", "8", "--runs", "1")
    # Without --config: MAGI2_PREVIEW is assumed, and the shape error says what to do.
    one_error_line(mhmoe(*run, check=False), "no mhmoe metadata", "--config")
    config = tmp_path / "layer.json"
    config.write_text(MAGI2_PREVIEW.replace(num_experts=2, top_k=2).to_json())
    out = mhmoe(*run, "--config", str(config)).stdout
    assert f"--config {config}" in out and "12 heads x 2 experts" in out and "(ok:" in out
    # quantize resolves the config the same way, hint included
    one_error_line(mhmoe("quantize", str(ckpt), str(tmp_path / "q"), check=False),
                   "no mhmoe metadata", "--config")
    assert not (tmp_path / "q").exists()
    assert "MoE layers [2]" in mhmoe("quantize", str(ckpt), str(tmp_path / "q"), "--config",
                                     str(config)).stdout
    one_error_line(mhmoe(*run, "--config", "magi3", check=False), "neither a preset",
                   "magi2_preview")
    one_error_line(mhmoe(*run, "--config", str(tmp_path / "nope.json"), check=False),
                   "no such file")
    one_error_line(mhmoe(*run, "--config", "magi2_preview", check=False), "shape")
    one_error_line(mhmoe("demo", "--config", "magi2_preview", check=False), "--config",
                   "--checkpoint")


def test_text_is_printed_as_it_is_not_as_markup(tmp_path):
    # rich read text as markup: "[plot]" vanished and "[/x]" crashed the command.
    odd = tmp_path / "a[/x]" / "run[plot] :smile:"
    out = make_checkpoint(odd).stdout
    assert f"to {odd}:" in out
    out = mhmoe("inspect", str(odd)).stdout
    assert f"MoE layers of {odd}" in out and "no problems found" in out
    line = one_error_line(mhmoe("inspect", str(odd / "[/missing]"), check=False))
    assert str(odd / "[/missing]") in line


def test_bench_out_is_checked_before_the_sweep(tmp_path):
    sweep = ("bench", "--tokens", "4", "--experts", "2", "--runs", "1", "--out")
    (tmp_path / "file").write_text("")
    for out, words in ((f"{tmp_path}/results/", ["names a directory"]),
                       (str(tmp_path), ["is a directory"]),
                       (str(tmp_path / "file" / "b.json"), ["is not a directory"]),
                       (str(tmp_path / "b.png"), [".json"])):
        one_error_line(mhmoe(*sweep, out, check=False), out, *words)
    # No sweep ran, so nothing was written: no DIR.tmp beside a trailing-slash path.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_ignored_flag_combinations_are_refused():
    for args, words in ((["--layer", "3"], ["--layer", "--checkpoint"]),
                        (["--nproc", "1"], ["--nproc", "at least 2"]),
                        (["--train", "--nproc", "2"], ["--train", "--nproc"]),
                        (["--experts", "2", "--checkpoint", "x"], ["--experts"]),
                        (["--full", "--experts", "2"], ["--full", "--experts"]),
                        (["--steps", "3"], ["--steps", "--train"]),
                        (["--nproc", "2", "--dtype", "fp32"], ["--dtype"]),
                        (["--train", "--deterministic"], ["--deterministic"])):
        one_error_line(mhmoe("demo", *args, check=False), *words)


def test_make_checkpoint_flags_are_checked(tmp_path):
    target = str(tmp_path / "c")
    one_error_line(mhmoe("make-checkpoint", target, "--layers", "a,b", check=False),
                   "--layers", "a,b")
    one_error_line(mhmoe("make-checkpoint", target, "--layers", "2,2", check=False),
                   "--layers", "more than once")
    one_error_line(mhmoe("make-checkpoint", target, "--shard-mb", "0", check=False),
                   "--shard-mb")
    assert not (tmp_path / "c").exists()


_DEEP_ERROR = """
import sys
import mhmoe.layer
from mhmoe.cli import main

def forward_heads(self, x_heads):
    raise {error}("an invariant broke deep inside (simulated)")

mhmoe.layer.MultiHeadMoE.forward_heads = forward_heads
raise SystemExit(main(["demo", "--tokens", "4", "--experts", "2", "--runs", "1"]))
"""


@pytest.mark.parametrize("error", ["ValueError", "OSError"])
def test_an_unexpected_error_is_a_bug_with_its_traceback(error):
    # Every ValueError and OSError was reported as a usage error (exit 2, no traceback):
    # a bug looked like the user's mistake. Only checked input is exit 2.
    proc = subprocess.run([sys.executable, "-c", _DEEP_ERROR.format(error=error)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert "Traceback" in proc.stderr and "in forward_heads" in proc.stderr, proc.stderr
    assert f"internal error ({error}: an invariant broke deep inside (simulated))" \
        in proc.stderr, proc.stderr


def test_input_errors_are_still_one_line():
    # A flag's value, a path, an unusable --backend: exit 2, one line, no traceback.
    one_error_line(mhmoe("demo", "--seed", str(2 ** 64), check=False), "--seed", "2**62")
    one_error_line(mhmoe("inspect", "/nonexistent/ckpt", check=False), "/nonexistent/ckpt")
    no_interpreter = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    one_error_line(mhmoe("demo", "--device", "cpu", "--backend", "triton", "--experts", "2",
                         check=False, env=no_interpreter, own_process=True), "--backend",
                   "cannot run on cpu")


def test_unusable_devices_and_memory_are_one_line():
    one_error_line(mhmoe("demo", "--device", "foo", check=False), "--device", "foo")
    one_error_line(mhmoe("demo", "--device", "mps", check=False), "--device mps")
    # 1.2 TB asked for: in a process of its own, not the test process
    one_error_line(mhmoe("demo", "--experts", "2", "--tokens", "100000000", "--device", "cpu",
                         check=False, own_process=True), "out of memory", "--tokens")


def test_demo_train_loss_falls():
    out = mhmoe("demo", "--train", "--steps", "12").stdout
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.8 * first and "% lower): ok" in out, out
    # The step time, and its TFLOP/s as 3x the forward FLOPs of this layer and token count
    # (12 heads, top-2 of 4 experts, D 256, I 256, 64 tokens: 2 * 3 * 64 * 12 * 2 * 256 * 256),
    # printed to 4 significant digits.
    found = re.search(r"step time ([0-9.]+) ms .* ([0-9.e+-]+) TFLOP/s", out)
    ms, tflops = map(float, found.groups())
    assert ms > 0
    assert tflops == pytest.approx(3 * 2 * 3 * 64 * 12 * 2 * 256 * 256 / (ms * 1e-3) / 1e12,
                                   rel=2e-3)


def test_bench_without_matplotlib_still_writes_json(tmp_path):
    # A process of its own: matplotlib is missing before mhmoe is imported, so an import
    # of it at a module's top level fails here (in this process mhmoe is imported already).
    out_json = tmp_path / "b.json"
    code = ("import sys; sys.modules['matplotlib'] = None; from mhmoe.cli import main; "
            f"raise SystemExit(main(['bench', '--tokens', '4', '--experts', '2', '--runs', '1', "
            f"'--out', {str(out_json)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # printed as written: rich used to read "[plot]" as markup and drop it
    assert "matplotlib is not installed (pip install 'mhmoe[plot]')" in proc.stdout
    assert json.loads(out_json.read_text())["rows"]


def test_package_metadata():
    # A license, classifiers and type hints for users; the torch it claims is the one CI
    # tests (requirements-cpu.txt pins the lowest version the package accepts).
    tomllib = pytest.importorskip("tomllib")
    root = SRC.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())
    meta = project["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    license_text = (root / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "the mhmoe authors" in license_text
    assert "Typing :: Typed" in meta["classifiers"] and len(meta["classifiers"]) >= 5
    assert (SRC / "mhmoe" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["mhmoe"]
    (torch_req,) = [d for d in meta["dependencies"] if re.match(r"torch\b", d)]
    lowest = re.fullmatch(r"torch>=([\d.]+)", torch_req).group(1)
    pins = re.findall(r"^torch==([\d.]+)", (root / "requirements-cpu.txt").read_text(), re.M)
    assert pins and all(pin.startswith(lowest) for pin in pins), (torch_req, pins)


def test_out_of_memory_messages_are_one_line():
    # The CPU allocator's error (seen above through the command) and the CUDA one.
    import torch

    from mhmoe.cli import _is_out_of_memory, _memory_message

    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.14 TiB. GPU 0 has a total capacity of 139.81 "
        "GiB of which 138.2 GiB is free. Including non-PyTorch memory, this process has 1.1 "
        "GiB memory in use. " + "Of the allocated memory ... " * 20)
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                       "can't allocate memory: you tried to allocate 1228800000000 bytes. "
                       "Error code 12 (Cannot allocate memory)")
    for error, start in ((cuda, "CUDA out of memory. Tried to allocate 1.14 TiB."),
                         (cpu, "can't allocate memory: you tried to allocate 1228800000000"),
                         (MemoryError(), "MemoryError")):
        assert _is_out_of_memory(error)
        message = _memory_message(error)
        assert "\n" not in message and len(message) < 300, message
        assert message.startswith(f"out of memory ({start}"), message
    assert not _is_out_of_memory(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------------------------------
# fp8: mhmoe quantize, inspect of an fp8 checkpoint, demo --fp8 (docs/fp8.md)
# ---------------------------------------------------------------------------------------


def _snapshot(directory):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_quantize_writes_an_fp8_checkpoint_and_leaves_the_source(tmp_path):
    import torch

    import mhmoe as lib

    src, dst = tmp_path / "src", tmp_path / "dst"
    make_checkpoint(src, "--layers", "2,3", "--prefix", "transformer.")
    before = _snapshot(src)
    out = mhmoe("quantize", str(src), str(dst)).stdout
    assert "wrote 3 file(s)" in out and "MoE layers [2, 3]" in out, out
    assert _snapshot(src) == before  # never touched
    out = mhmoe("inspect", str(dst)).stdout
    assert "quantization (from metadata): fp8-e4m3fn" in out and "no problems found" in out
    assert "float8_e4m3fn" in out and "W_down_scale" in out
    for layer in (2, 3):
        fp8 = lib.load_layer(dst, layer)
        ref = lib.quantize(lib.load_layer(src, layer), "fp8")
        for name, value in ref.state_dict().items():
            got = fp8.state_dict()[name]
            if value.dtype == torch.float8_e4m3fn:
                got, value = got.contiguous().view(torch.uint8), value.contiguous().view(
                    torch.uint8)
            assert torch.equal(got, value), (layer, name)
    # a subset of the layers, into one file; the demo runs it against its float64 twin
    one = tmp_path / "one"
    assert "MoE layers [3]" in mhmoe("quantize", str(src / "model.safetensors"), str(one),
                                     "--layers", "3").stdout
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]
    out = mhmoe("demo", "--checkpoint", str(one), "--layer", "3", "--tokens", "16",
                "--runs", "1").stdout
    # the PyTorch path is the float64 twin: checked against the formula instead
    assert "float8_e4m3fn" in out and "the float64 twin of the fp8 kernel" in out, out
    assert "vs float64 of the dequantized weights (ok: under 0.065;" in out, out


def test_quantize_refuses_what_would_touch_the_source_or_another_model(tmp_path):
    src = tmp_path / "src"
    make_checkpoint(src, "--layers", "2")
    before = _snapshot(src)
    for dst in (src, src / "fp8", src / "model.safetensors"):
        one_error_line(mhmoe("quantize", str(src), str(dst), check=False),
                       "source checkpoint's directory")
    one_error_line(mhmoe("quantize", str(src / "model.safetensors"), str(src / "sub"),
                         check=False), "source checkpoint's directory")
    assert _snapshot(src) == before and not (src / "fp8").exists()
    one_error_line(mhmoe("quantize", str(tmp_path / "nope"), str(tmp_path / "d"),
                         check=False), "no such file")
    one_error_line(mhmoe("quantize", str(src), str(tmp_path / "d"), "--layers", "2,9",
                         check=False), "no MoE layer(s) [9]", "[2]")
    # a directory holding another model: refused, unless --overwrite
    other = tmp_path / "other"
    make_checkpoint(other, "--layers", "7")
    kept = _snapshot(other)
    one_error_line(mhmoe("quantize", str(src), str(other), check=False),
                   "already holds a checkpoint", "--overwrite")
    assert _snapshot(other) == kept
    mhmoe("quantize", str(src), str(other), "--overwrite")
    assert "MoE layers" in mhmoe("inspect", str(other)).stdout
    # an fp8 checkpoint is not quantized again
    one_error_line(mhmoe("quantize", str(other), str(tmp_path / "again"), check=False),
                   "already holds fp8")


def test_inspect_checks_an_fp8_checkpoint_s_scales(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_checkpoint(src)
    mhmoe("quantize", str(src), str(dst))

    def zero_scale(tensors, metadata):
        tensors["block.layers.2.mlp.moe_mlp.W_up_scale"][3, 5] = 0.0

    rewrite_safetensors(dst / "model.safetensors", zero_scale)
    proc = mhmoe("inspect", str(dst), check=False)
    assert proc.returncode == 1 and "W_up_scale" in proc.stdout and "not > 0" in proc.stdout
    one_error_line(mhmoe("demo", "--checkpoint", str(dst), "--layer", "2", "--tokens", "4",
                         check=False), "W_up_scale")


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" and not _cuda(),
        reason="the fp8 kernel: a GPU or the Triton interpreter"))])
def test_demo_fp8_builds_a_stack_and_checks_it(backend):
    # Two layers on the PyTorch twin; one through the interpreted fp8 kernel (two took two
    # minutes of the CPU suite), whose check is the kernel's own.
    layers = "2" if backend == "torch" else "1"
    out = mhmoe("demo", "--fp8", "--experts", "2", "--layers", layers, "--tokens", "24",
                "--check-tokens", "8", "--runs", "1", "--backend", backend).stdout
    for field in ("device memory", "ms a pass", "ms a layer", f"{layers} x (hidden 3072, 12 "
                  "heads x 2 experts", "parameters", "on 8 of the 24 tokens of layer 1"):
        assert field in out, out
    assert ("time (CUDA graph)" in out) == _cuda(), out
    err = float(re.search(r"rel\. error\s*\S\s*([0-9.e+-]+)", out).group(1))
    if backend == "torch":  # the twin itself, against the formula on the dequantized weights
        assert "the float64 twin of the fp8 kernel" in out, out
        assert "vs float64 of the dequantized weights (ok: under 0.065;" in out, out
        assert 1e-3 < err < 6.5e-2, out  # e4m3 activations: measured about 4e-2
    else:  # the kernel, against its float64 twin
        assert "the fp8 expert kernel" in out and "vs its float64 twin (ok: under 0.01;" in out
        assert 1e-5 < err < 1e-2, out


def test_demo_graph_time_is_cuda_only():
    # (the demos' rows: test_demo_prints_its_table, test_demo_fp8_builds_a_stack_and_checks_it)
    import torch

    from mhmoe import cli

    assert cli._graph_time(lambda: None, torch.device("cpu"), 2) is None


def test_demo_fp8_flag_combinations_are_refused():
    for args, words in ((["--fp8", "--dtype", "fp32"], ["--dtype", "--fp8"]),
                        (["--fp8", "--checkpoint", "x"], ["--checkpoint", "--fp8"]),
                        (["--fp8", "--train"], ["--train", "--fp8"]),
                        (["--fp8", "--nproc", "2"], ["--nproc", "--fp8"]),
                        (["--layers", "2"], ["--layers", "--fp8"]),
                        (["--fp8", "--layers", "37"], ["--layers", "at most 36, got 37"]),
                        (["--fp8", "--full", "--experts", "2"], ["--full", "--experts"])):
        one_error_line(mhmoe("demo", *args, check=False), *words)
    assert "quantize" in mhmoe("--help").stdout
    assert "--overwrite" in mhmoe("quantize", "--help").stdout
