"""The manual stays true: generated pages equal what the code generates now, every file path the
docs name exists, and the README keeps its shape (two commands first, no lab notebook)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtpserve.benchmarks import results_readme
from mtpserve.cluster import config_docs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Pages whose file paths must exist (the chart's README has its own tests).
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
# A path names a file when it ends in one of these; folders are backticked and end in "/".
_EXT = r"(?:py|md|yaml|yml|json|toml|tpl|png|sh|txt)"
_FILE = re.compile(rf"(?<![\w./:$~-])((?:\.{{1,2}}/)?(?:[\w.-]+/)+[\w.-]+\.{_EXT})(?![\w/])")
_FOLDER = re.compile(r"`((?:\.{1,2}/)?(?:[\w.-]+/)+)`")
_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
# Relative names in prose (`kv_transfer/puller.py`) are read against these folders too.
_BASES = ("", "workers", "router", "cluster", "benchmarks", "tests")


def _resolves(page: Path, name: str) -> bool:
    if name.startswith(("../", "./")):
        return (page.parent / name).exists()
    return any((page.parent / name).exists() or (ROOT / base / name).exists()
               for base in _BASES)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def missing_paths(page: Path, text: str) -> list[str]:
    """File and folder paths named in `text` (a page at `page`) that do not exist, and links
    (relative to the page, as GitHub resolves them) to a missing file or heading."""
    names = set(_FILE.findall(text)) | set(_FOLDER.findall(text))
    bad = {n for n in names if not _resolves(page, n)}
    for target, anchor in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target) if target else page
        if not path.exists():
            bad.add(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.add(f"{target}#{anchor}")
    return sorted(bad)


@pytest.fixture
def no_model_override(monkeypatch: pytest.MonkeyPatch) -> None:
    # The page shows the embedded model as `model`'s default, whatever this shell points at.
    monkeypatch.delenv("MTPSERVE_MODEL", raising=False)


def test_configuration_page_is_generated_from_the_code(no_model_override: None) -> None:
    page = ROOT / config_docs.OUTPUT
    assert page.read_text() == config_docs.render(), (
        "docs/configuration.md is stale: python -m mtpserve.cluster.config_docs --write")


def test_configuration_page_lists_every_field(no_model_override: None) -> None:
    """Every leaf key of ClusterConfig (nested sections included) has a row."""
    from pydantic import BaseModel

    from mtpserve.cluster.config import ClusterConfig

    def keys(cls: type[BaseModel], prefix: str) -> set[str]:
        out = set()
        for name, field in cls.model_fields.items():
            out.add(prefix + name)
            sub = config_docs._section_type(field.annotation)
            if sub is not None:
                out |= keys(sub, f"{prefix}{name}.")
        return out

    text = config_docs.render()
    rows = dict(re.findall(r"^\| `([\w.]+)` \|(.*)$", text, re.M))
    # A section used under a second key (decode.autoscaling) is listed once, under the first,
    # and the second key's row says "Same keys as [`prefill.autoscaling`]".
    missing = []
    for key in keys(ClusterConfig, ""):
        if key in rows:
            continue
        owner = max((r for r in rows if key.startswith(r + ".")), key=len, default="")
        same = re.search(r"Same keys as \[`([\w.]+)`\]", rows.get(owner, ""))
        if not (same and same.group(1) + key[len(owner):] in rows):
            missing.append(key)
    assert missing == []


def test_every_environment_variable_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    found = config_docs.env_vars_in_source()
    assert "MTPSERVE_COMPILE" in found and found <= set(config_docs.ENV_VARS)
    # The generator refuses to write the page while one is undescribed.
    monkeypatch.setattr(config_docs, "ENV_VARS",
                        {k: v for k, v in config_docs.ENV_VARS.items() if k != "MTPSERVE_COMPILE"})
    with pytest.raises(SystemExit, match="MTPSERVE_COMPILE"):
        config_docs.render()


def test_benchmarks_readme_is_generated_from_the_results() -> None:
    assert results_readme.OUTPUT.read_text() == results_readme.render(), (
        "benchmarks/README.md is stale: python -m mtpserve.benchmarks.results_readme --write")


def test_every_benchmark_script_is_listed() -> None:
    listed = {b.script for b in results_readme.BENCHMARKS} | results_readme.HELPERS
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - listed == set()
    for b in results_readme.BENCHMARKS:
        for name in b.results:
            assert (results_readme.RESULTS / name).is_file(), name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page: Path) -> None:
    assert missing_paths(page, page.read_text()) == []


@pytest.mark.parametrize("text, bad", [
    ("see `workers/spec/keyed_random.py`", "workers/spec/keyed_random.py"),
    ("held in `kv_transfer/arrivals.py`", "kv_transfer/arrivals.py"),
    ("the folder `workers/spec/`", "workers/spec/"),
    ("[the card](models/no-such-model/README.md)", "models/no-such-model/README.md"),
    ("[docs](docs/api.md#no-such-heading)", "docs/api.md#no-such-heading"),
    ("[from a page](configuration.md)", "configuration.md"),  # relative to README's folder
])
def test_the_path_check_sees_a_missing_path(text: str, bad: str) -> None:
    assert missing_paths(README, text) == [bad]
    good = ("`workers/spec_decode/keyed_random.py`, `workers/replica/arrivals.py`, `workers/`, "
            "[errors](docs/api.md#errors)")
    assert missing_paths(README, good) == []


def test_readme_shape() -> None:
    lines = README.read_text().splitlines()
    commands = [line for line in lines if line.startswith("    $ ")]
    # .ci/run runs the second `    $ ` line: exactly two, install-and-serve then the tests.
    assert len(commands) == 2
    assert commands[0].endswith("mtpserve up") and commands[1].endswith("pytest")
    assert lines.index(commands[0]) < 5
    assert len(lines) <= 250
    text = "\n".join(lines)
    # No lab notebook: run or session labels, issue numbers, hand-kept test counts.
    assert not re.search(r"\brun ?\d\b|\bsession \d|\bissue #?\d|#\d{1,3}\b|\d+ tests\b", text)
    # The engine claim the README makes is the folder rule test_layering enforces.
    assert "never imports Ray" not in text


def test_readme_headline_numbers_come_from_the_result_it_names() -> None:
    """Every number in the README's speed table is in the result file the section names."""
    import json

    text = README.read_text()
    section = text[text.index("## Measured speed"):]
    section = section[: section.index("\n## ", 1)]
    names = set(re.findall(r"benchmarks/results/([\w.-]+\.json)", section))
    assert names
    known: set[str] = set()
    for name in names:
        result = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        if "engine" in result:  # mtpserve bench engine
            known.add(f"{result['transformers']['tokens_per_s']:.1f}")
            for row in result["engine"]:
                known |= {f"{row['tokens_per_s']:.1f}", f"{row['mean_accepted_length']:.2f}"}
                if row["speedup_vs_k0"] is not None:
                    known.add(f"{row['speedup_vs_k0']:.2f}x")
        else:  # the peer benchmark: tok/s, tokens per round, batch sizes and ks
            known |= {str(b) for b in result["batch_sizes"]}
            for r in result["offline"]:
                known.add(str(r["k"]))
                for x in r["rows"]:
                    known |= {f"{x['tokens_per_s']:.0f}", f"{x['tokens_per_round']:.2f}"}
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    numbers = re.findall(r"\d+(?:\.\d+)?x?", table)
    assert numbers and set(numbers) <= known, set(numbers) - known
