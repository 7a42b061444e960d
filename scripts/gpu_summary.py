"""The report of scripts/gpu-check: the machine's versions (``env``) and the summary of its stages (``summary``).

    python3 scripts/gpu_summary.py env                       # versions, the GPU, the carried wheels' needs
    python3 scripts/gpu_summary.py summary REPORT_DIR --stage NAME STATUS DETAIL ... [--junit STAGE FILE]

Standard library and torch only (packaging when there), so it runs on the bare GPU image too.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from importlib import metadata
from pathlib import Path

WHEELS = Path(__file__).with_name("gpu-wheels.txt")
VERSIONS = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "sentencepiece", "prometheus-client",
            "httpx", "anyio", "pytest"]  # fmt: skip
TARGETS = ["cuda-float32", "cuda-bfloat16", "cuda-float16"]


def wheel_names() -> list[str]:
    """The names in scripts/gpu-wheels.txt."""
    lines = (line.split("#", 1)[0].strip() for line in WHEELS.read_text().splitlines())
    return [line.split("==", 1)[0] for line in lines if line]


def version(name: str) -> str:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return "not installed"
    return f"{dist.version} ({Path(str(dist.locate_file(''))).resolve()})"


def unmet_needs(names: list[str]) -> list[str]:
    """The carried packages' requirements (no extras) that the installed versions do not meet."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["(packaging is not installed: needs not checked)"]
    problems = []
    for name in names:
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: {have} installed")
    return problems


def gpu_lines() -> tuple[list[str], bool]:
    """Lines on torch and its GPU, and whether a CUDA device is there."""
    try:
        import torch
    except ImportError as exc:
        return [f"torch: cannot import ({exc})"], False
    lines = [f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"]
    if not torch.cuda.is_available():
        return [*lines, "no CUDA device: torch.cuda.is_available() is False"], False
    props = torch.cuda.get_device_properties(0)
    bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    lines.append(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                 f"{props.major}.{props.minor}, {props.multi_processor_count} SMs, bf16 {bf16}, "
                 f"{torch.cuda.device_count()} device(s)")
    return lines, True


def env() -> None:
    """Print the versions the check ran with (env.txt)."""
    lines, _ = gpu_lines()
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    print(*lines, sep="\n")
    print("\npackages:")
    for name in VERSIONS:
        print(f"  {name} {version(name)}")
    names = wheel_names()
    print("\ncarried (scripts/gpu-wheels.txt):")
    for name in names:
        print(f"  {name} {version(name)}")
    problems = unmet_needs(names)
    print("\ncarried wheels' needs: " + ("all met" if not problems else "UNMET"))
    print(*(f"  {p}" for p in problems), sep="\n")


def _case_target(name: str) -> str:
    """The target of a test id: "cuda-bfloat16" from "test_x[cuda-bfloat16-tiny-lm]", else "other"."""
    found = re.search(r"\[(?:.*-)?(cuda-(?:float32|bfloat16|float16))(?:-|\])", name)
    return found.group(1) if found else "other"


def read_junit(path: Path) -> tuple[Counter, dict[str, Counter], list[str]]:
    """(totals, per check "file::test" the outcomes by target, failure lines) of a JUnit XML file."""
    totals: Counter = Counter()
    checks: dict[str, Counter] = defaultdict(Counter)
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name:  # the test a time-out interrupted: pytest writes it without a name
            totals["interrupted"] += 1
            continue
        check = f"{case.get('classname', '')}::{name.split('[', 1)[0]}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "errors"}.get(tag, tag)
                if tag != "skipped":
                    message = (found.get("message") or found.text or "").strip().splitlines()
                    failures.append(f"{case.get('classname')}::{name}: {message[0][:300] if message else tag}")
                break
        totals[outcome] += 1
        checks[check][(_case_target(name), outcome)] += 1
    return totals, checks, failures


def _counts(counter: Counter) -> str:
    order = ("passed", "failed", "errors", "skipped", "interrupted")
    return ", ".join(f"{counter[k]} {k}" for k in order if counter[k]) or "no tests"


def _check_table(checks: dict[str, Counter]) -> list[str]:
    other = any(t == "other" for outcomes in checks.values() for t, _ in outcomes)
    columns = TARGETS + ["other"] * other
    rows = ["| check | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for check, outcomes in sorted(checks.items()):
        cells = []
        for target in columns:
            got = Counter({k: n for (t, k), n in outcomes.items() if t == target})
            cells.append(_counts(got) if got else "-")
        rows.append(f"| {check} | " + " | ".join(cells) + " |")
    return rows


def summary(report: Path, stages: list[list[str]], junits: list[list[str]]) -> bool:
    """Write report/summary.md; True when no stage failed."""
    gpu, has_gpu = gpu_lines()
    ok = all(status in ("ok", "skipped") for _, status, _ in stages)
    lines = [f"# GPU check, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", ""]
    lines += [f"- python {platform.python_version()}; " + "; ".join(gpu),
              "- versions: " + ", ".join(f"{n} {version(n).split(' ')[0]}" for n in ("transformers", "tokenizers",
                                                                                     "numpy", "fastapi", "pydantic"))]
    problems = unmet_needs(wheel_names())
    lines.append("- carried wheels' needs: " + ("all met" if not problems else "UNMET: " + "; ".join(problems)))
    if not has_gpu:
        lines.append("- **no CUDA device**: the cuda tests skip (this is not a GPU check)")
    lines += ["", "| stage | status | detail |", "|---|---|---|"]
    details = []
    for name, status, detail in stages:
        junit = next((Path(f) for s, f in junits if s == name), None)
        if junit is not None and junit.is_file():
            totals, checks, failures = read_junit(junit)
            detail = f"{_counts(totals)}; {detail}"
            ok = ok and not (totals["failed"] or totals["errors"] or totals["interrupted"])
            if has_gpu and not totals["passed"] and not totals["failed"] and not totals["errors"]:
                ok = False  # a GPU is there and nothing ran: not a pass
                detail += "; nothing ran"
            details += ["", f"## {name}: by check and target", "", *_check_table(checks)]
            if failures:
                details += ["", f"## {name}: failures", "", *(f"- {f}" for f in failures[:40])]
                if len(failures) > 40:
                    details.append(f"- ... {len(failures) - 40} more in {junit.name}")
        lines.append(f"| {name} | {status} | {detail} |")
    lines += ["", f"**{'PASS' if ok else 'FAIL'}**", *details]
    (report / "summary.md").write_text("\n".join(lines) + "\n")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the versions the check runs with")
    p = sub.add_parser("summary", help="write REPORT/summary.md; exit 1 when a stage failed")
    p.add_argument("report", type=Path)
    p.add_argument("--stage", nargs=3, action="append", default=[], metavar=("NAME", "STATUS", "DETAIL"),
                   help="a stage's outcome (STATUS ok, skipped, failed or timed out), in order")
    p.add_argument("--junit", nargs=2, action="append", default=[], metavar=("STAGE", "FILE"),
                   help="the JUnit XML of a stage: counts, failures and a table by check and target")
    args = parser.parse_args()
    if args.command == "env":
        env()
        return 0
    return 0 if summary(args.report, args.stage, args.junit) else 1


if __name__ == "__main__":
    sys.exit(main())
