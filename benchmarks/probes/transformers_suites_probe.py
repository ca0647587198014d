"""Transformers' own model test suites, run on Transformers' classes and again with moetune's in their place.

For each family moetune implements, the suite ``tests/models/<family>/test_modeling_<family>.py`` of a
Transformers source tree is run twice with pytest: as it is, and with moetune's classes substituted for
Transformers' (this module is then also the pytest plugin that substitutes them). The outcome of every
test is compared; a test that passes on Transformers' classes and not on moetune's is a gap.

    python benchmarks/probes/transformers_suites_probe.py --suite-root /path/to/transformers-src \
        [--families qwen3_moe gpt_oss] [--out results.json] [-- extra pytest args]

``--suite-root`` is a folder holding Transformers' ``tests/`` package (``tests/models/<family>/``,
``tests/causal_lm_tester.py``, ``tests/test_modeling_common.py``, ``tests/generation/test_utils.py``,
...) for the Transformers version installed; nothing from it is copied into moetune. What is
substituted, where the suite names the classes: the test module's globals, the test class's
``all_model_classes`` and ``pipeline_model_mapping``, the model tester's class attributes
(``base_model_class``, ``causal_lm_class``), and ``AutoModelForCausalLM`` in ``tests.causal_lm_tester``
(moetune's auto class, the import a user swaps). Head classes Transformers has and moetune does not
(sequence classification, ...) stay Transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

SUBSTITUTE_ENV = "MOETUNE_SUBSTITUTE_CLASSES"
PLUGIN = Path(__file__).stem


def moetune_classes() -> dict[type, type]:
    """Transformers' class -> moetune's, for the base model and the causal LM of every family."""
    from moetune.models import FAMILIES

    mapping: dict[type, type] = {}
    for family in FAMILIES.values():
        # Before ModelFamily named it, the backbone was the class named like the causal LM in its module.
        base_model = getattr(family, "base_model", None) or getattr(
            sys.modules[family.causal_lm.__module__], family.causal_lm.__name__.replace("ForCausalLM", "Model")
        )
        for ours in (family.causal_lm, base_model):
            theirs = next(base for base in ours.__mro__[1:] if base.__module__.startswith("transformers."))
            mapping[theirs] = ours
    return mapping


def _substituted(value, mapping: dict[type, type]):
    if isinstance(value, type):
        return mapping.get(value, value)
    if isinstance(value, (tuple, list)):
        return type(value)(_substituted(v, mapping) for v in value)
    if isinstance(value, dict):
        return {k: _substituted(v, mapping) for k, v in value.items()}
    return value


def substitute_in_module(module, mapping: dict[type, type]) -> None:
    """Put moetune's classes where a test module (and its test and tester classes) names Transformers'."""
    for name, value in list(vars(module).items()):
        if isinstance(value, type) and value in mapping:
            setattr(module, name, mapping[value])
        elif isinstance(value, type) and value.__module__ == module.__name__:  # the module's own test and tester classes
            _substitute_in_class(value, mapping)


def _substitute_in_class(cls: type, mapping: dict[type, type]) -> None:
    if hasattr(cls, "_verify_and_infer_model_attributes"):
        # A CausalLMModelTester: infer its head classes from Transformers' base model first (they stay
        # Transformers'), then swap the classes moetune implements.
        cls._verify_and_infer_model_attributes()
    for attribute in ("all_model_classes", "pipeline_model_mapping", "base_model_class", "causal_lm_class"):
        if attribute in vars(cls):
            setattr(cls, attribute, _substituted(vars(cls)[attribute], mapping))


# ---------------------------------------------------------------- the pytest plugin


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get(SUBSTITUTE_ENV) != "1":
        return
    import moetune

    mapping = moetune_classes()
    modules = {item.module for item in items if getattr(item, "module", None) is not None}
    for module in modules:
        substitute_in_module(module, mapping)
    causal_lm_tester = sys.modules.get("tests.causal_lm_tester")
    if causal_lm_tester is not None:
        causal_lm_tester.AutoModelForCausalLM = moetune.AutoModelForCausalLM


# ---------------------------------------------------------------- the runner


def run_suite(suite_root: Path, family: str, *, substitute: bool, report: Path, pytest_args: list[str]) -> dict[str, str]:
    """pytest on one family's suite; {test id: passed | failed | skipped | error}."""
    test_file = suite_root / "tests" / "models" / family / f"test_modeling_{family}.py"
    if not test_file.is_file():
        raise FileNotFoundError(f"no {test_file.relative_to(suite_root)} under --suite-root {suite_root}")
    env = dict(os.environ)
    env[SUBSTITUTE_ENV] = "1" if substitute else "0"
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, str(suite_root), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "pytest", str(test_file), "-p", PLUGIN, "-p", "no:cacheprovider", "-q",
               "-p", "no:warnings", f"--junitxml={report}", *pytest_args]  # fmt: skip
    subprocess.run(command, cwd=suite_root, env=env, check=False)
    return read_junit(report)


def read_junit(report: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = "failed" if "failure" in tags else "error" if "error" in tags else "skipped" if "skipped" in tags else "passed"
        outcomes[name] = outcome
    return outcomes


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    result = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in outcomes.values():
        result[outcome] += 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite-root", type=Path, required=True, help="a folder holding Transformers' tests/ package")
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h"])
    parser.add_argument("--out", type=Path, default=None, help="write every test's two outcomes here (JSON)")
    parser.add_argument("--reports", type=Path, default=Path("transformers_suites_reports"), help="junit XML folder")
    parser.add_argument(
        "--reuse-transformers", action="store_true",
        help="read the Transformers run's outcomes from --reports instead of running it again",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    args.reports.mkdir(parents=True, exist_ok=True)
    summary = {}
    for family in args.families:
        runs = {}
        for label, substitute in (("transformers", False), ("moetune", True)):
            report = args.reports / f"{family}_{label}.xml"
            if label == "transformers" and args.reuse_transformers:
                runs[label] = read_junit(report)
                continue
            runs[label] = run_suite(args.suite_root, family, substitute=substitute, report=report, pytest_args=args.pytest_args)
        gaps = sorted(t for t, o in runs["transformers"].items() if o == "passed" and runs["moetune"].get(t) != "passed")
        summary[family] = {
            "transformers": counts(runs["transformers"]),
            "moetune": counts(runs["moetune"]),
            "gaps": {t: runs["moetune"].get(t, "missing") for t in gaps},
            "tests": {t: [o, runs["moetune"].get(t, "missing")] for t, o in sorted(runs["transformers"].items())},
        }
        print(f"{family}: transformers {summary[family]['transformers']}  moetune {summary[family]['moetune']}  "
              f"passing on Transformers only: {len(gaps)}")  # fmt: skip
        for test in gaps:
            print(f"    {test}: {summary[family]['gaps'][test]}")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
