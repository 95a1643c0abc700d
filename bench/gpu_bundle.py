"""What ``bench/gpu_smoke.sh`` needs on a GPU machine that reaches no package registry, prepared here.

The GPU machine this project borrows (one H100 or H200, a quarter of an hour at a time) has Python 3.12
with torch, transformers, triton, tokenizers, safetensors, pyarrow, psutil and numpy, but no DeepSpeed,
and nothing can be installed there from an index. What travels is the working tree plus a few
folders (64 MiB in all). So, here, with PyPI:

    python bench/gpu_bundle.py prepare [--out .gpu_bundle] [--python-version 3.12]

writes ``.gpu_bundle/``: ``wheels/`` (DeepSpeed built here as a pure-Python wheel with no compiled ops,
at the version installed here, and the wheels of its dependencies that the GPU machine lacks, for
CPython 3.12 on manylinux x86-64, pinned to the versions installed here) and ``shards-seq128-val0.05/`` (the
embedded Wikipedia sample, bert-base-uncased vocabulary, through the real ``data_prep``), and prints
their size. There, in the repository root with ``.gpu_bundle`` carried beside it, one command:

    python3 bench/gpu_bundle.py run [-- GPU_SMOKE_ARGS...]

unpacks the wheels into ``.gpu_bundle/site`` (no pip, no index: a wheel is a zip archive) and runs
``bench/gpu_smoke.sh --data .gpu_bundle/shards-seq128-val0.05`` with that folder on ``PYTHONPATH`` and its
``bin`` (DeepSpeed's launcher) on ``PATH``; tracking is off in every smoke run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed's run-time dependencies that the GPU machine lacks (torch, numpy, packaging and tqdm it
# has), and psutil. pydantic's own: pydantic-core (compiled, per Python), annotated-types, typing-inspection,
# and a typing-extensions new enough for them.
DEPENDENCIES = (
    "psutil",  # imported by DeepSpeed and our launcher; the machine has it, but nothing says it must
    "einops",
    "hjson",
    "msgpack",
    "ninja",
    "py-cpuinfo",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRY_LIMIT_MB = 64  # the device tool's limit for the working tree and carried folders together
VALIDATION_FRACTION = 0.05  # a held-out split, so that evaluation runs (compiled) on the GPU too
SHARDS = f"shards-seq128-val{VALIDATION_FRACTION}"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _tracked_tree_mb() -> float:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return (
        sum((REPO / name).stat().st_size for name in files.decode().split("\0") if name and (REPO / name).is_file())
        / 2**20
    )


def prepare(out: Path, python_version: str) -> int:
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    # No compiled ops: the GPU machine has no nvcc for DeepSpeed's JIT, and the trainer needs none of
    # them (torch's fused AdamW, our LAMB; DeepSpeed's CPU Adam only under optimiser offload).
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            f"deepspeed=={metadata.version('deepspeed')}",
            "-w",
            str(wheels),
        ],
        check=True,
        env=env,
    )
    pins = [f"{name}=={metadata.version(name)}" for name in DEPENDENCIES]
    _pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *(a for p in PLATFORMS for a in ("--platform", p)),
        "-d",
        str(wheels),
        *pins,
    )

    sys.path.insert(0, str(REPO))
    from bench.common import ensure_sample_shards

    shards = ensure_sample_shards(out, validation_fraction=VALIDATION_FRACTION)
    shutil.rmtree(out / "corpus", ignore_errors=True)  # the text: sharded, not needed there
    bundle_mb, tree_mb = _size_mb(out), _tracked_tree_mb()
    for path in sorted(wheels.iterdir()):
        print(f"  {path.name}  {path.stat().st_size / 2**20:.2f} MiB")
    print(
        f"{out}: {bundle_mb:.1f} MiB ({wheels.name}/ {_size_mb(wheels):.1f}, {shards.name}/ "
        f"{_size_mb(shards):.1f}); with the tracked tree ({tree_mb:.1f} MiB): {bundle_mb + tree_mb:.1f} of "
        f"{CARRY_LIMIT_MB} MiB"
    )
    if bundle_mb + tree_mb > CARRY_LIMIT_MB:
        print(f"gpu_bundle: over the {CARRY_LIMIT_MB} MiB that can travel", file=sys.stderr)
        return 1
    print(
        f"carry '{out.relative_to(REPO) if out.is_relative_to(REPO) else out}' and run there: "
        "python3 bench/gpu_bundle.py run"
    )
    return 0


def install(bundle: Path) -> Path:
    """Every wheel of ``bundle/wheels`` unpacked into ``bundle/site``, as pip would lay it out: the
    packages at the top, scripts (DeepSpeed's ``deepspeed`` launcher) in ``bin`` for this Python."""
    site = bundle / "site"
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"gpu_bundle: no wheels in {bundle / 'wheels'}: run `python bench/gpu_bundle.py prepare` "
            "on a machine with PyPI and carry the folder"
        )
    shutil.rmtree(site, ignore_errors=True)
    (site / "bin").mkdir(parents=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                if member.is_dir():
                    continue
                parts = Path(member.filename).parts
                data = archive.read(member)
                executable = bool((member.external_attr >> 16) & 0o111)
                if parts[0].endswith(".data") and len(parts) > 2:  # name.data/<scheme>/...
                    scheme, rest = parts[1], Path(*parts[2:])
                    if scheme == "scripts":
                        target, executable = site / "bin" / rest, True
                        if data.startswith(b"#!python"):
                            data = f"#!{sys.executable}".encode() + data[len(b"#!python") :]
                    elif scheme in ("purelib", "platlib"):
                        target = site / rest
                    else:  # headers, data: not needed to run
                        continue
                else:
                    target = site / member.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                if executable:
                    target.chmod(0o755)
    return site


def run(bundle: Path, smoke_args: list[str]) -> int:
    site = install(bundle)
    shards = bundle / SHARDS
    if not (shards / "manifest.json").is_file():
        raise SystemExit(f"gpu_bundle: no {shards}/manifest.json: run prepare first")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")]),
    }
    found = subprocess.run(
        [sys.executable, "-c", "import deepspeed, pydantic; print(deepspeed.__version__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    if found.returncode:
        raise SystemExit(f"gpu_bundle: DeepSpeed does not import from {site}:\n{found.stderr[-2000:]}")
    print(f"gpu_bundle: DeepSpeed {found.stdout.split()[-1]} from {site}; shards {shards}", flush=True)
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_smoke.sh"), "--data", str(shards), *smoke_args], cwd=REPO, env=env
    ).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here, with PyPI: the wheels and shards to carry")
    p.add_argument("--out", type=Path, default=REPO / ".gpu_bundle")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    r = sub.add_parser("run", help="there, offline: unpack the wheels and run bench/gpu_smoke.sh")
    r.add_argument("--bundle", type=Path, default=REPO / ".gpu_bundle")
    r.add_argument("smoke_args", nargs=argparse.REMAINDER, help="after --: bench/gpu_smoke.sh's arguments")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.out.resolve(), args.python_version)
    smoke_args = args.smoke_args[1:] if args.smoke_args[:1] == ["--"] else args.smoke_args
    return run(args.bundle.resolve(), smoke_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
