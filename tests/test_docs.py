"""The README, CONTRIBUTING.md and benchmarks/README.md are promises: their commands run, their names exist, their
tables are generated from the data the package and the test plan hold, and the first screen gets a user to "it is on".

Every command meant to be run is extracted (fenced ``bash`` blocks; inline code spans that start with a program we
ship or document) and checked: it parses (``shlex``, ``bash -n``), its ``liger-ddp-patch`` verb and flags exist in
``liger_ddp_patch/cli.py``, every repository path it names exists, every ``LIGER_DDP_PATCH_*`` name is read by the
package or the test harness. The README's test command is ``.ci/run``'s last line (CI runs it from there).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import affected
import matrix
import pytest

from liger_ddp_patch import environment, pth
from liger_ddp_patch.patches import NAMES
from liger_ddp_patch.patches import trl_versions as tv
from liger_ddp_patch.patches.trainers import SPECS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")
TEST_COMMAND = "bash .ci/trl_matrix.sh --prepare-only && python3 -m pytest -q"
DEMO_COMMAND = 'python3 -m pip install "torch==2.13.0" && python3 -m pip install -e ".[test]" && liger-ddp-patch demo'
FIRST_SCREEN = 45  # lines: "is this me?" (the affected table) to "it is on" (import liger_ddp_patch)

# Variables the test harness (not the package) reads: .ci/trl_matrix.sh and tests/test_matrix.py.
HARNESS = {"LIGER_DDP_PATCH_FULL_MATRIX", "LIGER_DDP_PATCH_TRL_DIRS", "LIGER_DDP_PATCH_LIGER_DIRS",
           "LIGER_DDP_PATCH_MATRIX_OUT"}  # fmt: skip
# Documented ahead of the code landing in parallel (the loss settings); drop once environment.py defines it.
PENDING: set[str] = set()  # variables documented before environment.py reads them (none today)
# Programs whose inline commands are checked; anything else in backticks is a name, not a command.
PROGRAMS = ("liger-ddp-patch", "python", "python3", "bash", "torchrun", "accelerate", "pip")
REPO_DIRS = ("tests/", "benchmarks/", "liger_ddp_patch/", "sitecustomize_example/", ".ci/", "docs/")


def read(name: str) -> str:
    return (ROOT / name).read_text()


def blocks(text: str) -> list[tuple[int, str, str]]:
    """Every fenced block as (offset of its opening fence, language, body), fences paired in order."""
    found = [(m.start(), m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```\n", text, re.S | re.M)]
    return found


def fenced(text: str, lang: str) -> list[str]:
    return [body for _, language, body in blocks(text) if language == lang]


def bash_lines(text: str) -> list[str]:
    """Each command line of each ``bash`` block (backslash continuations joined; comments stay: bash reads them)."""
    return [line.strip() for block in fenced(text, "bash") for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]  # fmt: skip


def simple_commands(command: str) -> list[list[str]]:
    """The words of each simple command (split at ``&&``, ``||``, ``;``, ``|``), comments dropped, as bash would."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            out.append([])
        else:
            out[-1].append(token)
    return [words for words in out if words]


def inline_commands(text: str) -> list[str]:
    """Code spans outside fenced blocks that are commands: ``VAR=x program ...`` with a program we know."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if _is_command(span.split())]


def plain_block_commands(text: str) -> list[str]:
    """Lines of unlabelled fenced blocks that start with a program we know (continuations joined, as in bash)."""
    lines = (line.strip() for block in fenced(text, "") for line in block.replace("\\\n", " ").splitlines())
    return [line for line in lines if _is_command(line.split())]


def _is_command(words: list[str]) -> bool:
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return len(words) > 1 and words[0] in PROGRAMS


def commands(name: str) -> list[str]:
    text = read(name)
    return bash_lines(text) + plain_block_commands(text) + inline_commands(text)


def all_commands() -> list[tuple[str, str]]:
    return [(doc, cmd) for doc in DOCS for cmd in commands(doc)]


def cli_grammar() -> tuple[set[str], set[str], dict[str, set[str]]]:
    """Verbs, option flags and positional choices, read from cli.py's argparse calls (without running it)."""
    tree = ast.parse(read("liger_ddp_patch/cli.py"))
    verbs, flags, choices = set(), set(), {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if node.func.attr == "add_parser":
            verbs.add(first.value)
        elif node.func.attr == "add_argument":
            if first.value.startswith("--"):
                flags.add(first.value)
            for kw in node.keywords:
                if kw.arg == "choices":
                    choices[first.value] = {ast.literal_eval(e) for e in kw.value.elts}
    return verbs, flags, choices


def known_variables() -> tuple[set[str], set[str]]:
    """(user-facing: environment.py's names, the .pth switch, the pending ones; everything the harness reads too)."""
    package = {v for v in vars(environment).values() if isinstance(v, str) and v.startswith("LIGER_DDP_PATCH_")}
    user = package | {pth.VARIABLE} | PENDING
    harness_sources = read(".ci/trl_matrix.sh") + read("tests/test_matrix.py") + read("tests/matrix.py")
    assert HARNESS <= set(re.findall(r"LIGER_DDP_PATCH_[A-Z_]+", harness_sources)), "HARNESS names a dead variable"
    return user, user | HARNESS


# ------------------------------------------------------------------------------------------------- commands


def test_readme_test_command_is_what_ci_runs():
    readme = bash_lines(read("README.md"))
    assert TEST_COMMAND in readme, "README lost its test command"
    ci = [line for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == TEST_COMMAND, f".ci/run runs {ci[-1]!r}, the README says {TEST_COMMAND!r}"


def test_readme_demo_install_is_what_ci_installs():
    assert DEMO_COMMAND in bash_lines(read("README.md")), "README lost its demo command"
    ci = [line for line in read(".ci/run").splitlines() if line.startswith("python3 -m pip install --quiet ")]
    wanted = [part.strip() for part in DEMO_COMMAND.split("&&") if "pip install" in part]
    assert [line.replace(" --quiet", "") for line in ci if "--upgrade pip" not in line] == wanted


def test_there_are_commands_to_check():
    """The extraction itself must find what the docs hold (an empty list would pass everything below)."""
    readme = commands("README.md")
    assert TEST_COMMAND in readme and DEMO_COMMAND in readme
    assert "liger-ddp-patch run -- torchrun --nproc_per_node=8 train.py" in readme
    assert any(cmd.startswith("liger-ddp-patch pth install") for cmd in readme)
    assert len(commands("CONTRIBUTING.md")) >= 6 and len(commands("benchmarks/README.md")) >= 4


@pytest.mark.parametrize(("doc", "command"), all_commands())
def test_command_parses(doc, command):
    assert simple_commands(command), command  # raises on unbalanced quotes
    proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
    assert proc.returncode == 0, f"{doc}: `{command}` does not parse: {proc.stderr}"


@pytest.mark.parametrize(("doc", "command"), all_commands())
def test_command_names_what_exists(doc, command):
    verbs, flags, choices = cli_grammar()
    for words in simple_commands(command):
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["liger-ddp-patch"] or words[:3] == ["python3", "-m", "liger_ddp_patch"]:
            args = words[1:] if words[0] == "liger-ddp-patch" else words[3:]
            assert args and args[0] in verbs, f"{doc}: `{command}`: no verb {args[:1]} in cli.py ({sorted(verbs)})"
            if args[0] == "run":
                assert args[1:2] == ["--"], f"{doc}: `{command}`: run takes `-- CMD`"
                continue
            if args[0] == "pth":
                assert args[1:2] and args[1] in choices["action"], f"{doc}: `{command}`"
            for word in args[1:]:
                assert not word.startswith("--") or word in flags, f"{doc}: `{command}`: no flag {word} in cli.py"
        for word in words:
            path = word.split(":")[0].split("=")[-1]
            if path.startswith(REPO_DIRS) and not path.startswith("/"):
                assert (ROOT / path).exists(), f"{doc}: `{command}` names {path}, which does not exist"
        script = words[1] if words[0] in ("python", "python3", "bash") and len(words) > 1 else ""
        if script.startswith(REPO_DIRS) and script.endswith((".py", ".sh")):
            source = read(script)
            for word in words[2:]:
                flag = word.strip("[]").split("=")[0]  # `[--runs 30]`: usage notation for an option
                quoted = re.search(rf"[\"']{re.escape(flag)}[\"']", source)  # as argparse or a [[ ]] test spells it
                assert not flag.startswith("--") or quoted, f"{doc}: `{command}`: {script} has no {flag}"
            if script.startswith("tests/"):  # the docs generators: cheap, so run them (never their redirection)
                argv = words[: words.index(">")] if ">" in words else words
                proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True)
                assert proc.returncode == 0, f"{doc}: `{command}` fails: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("doc", DOCS)
def test_variables_exist(doc):
    _, known = known_variables()
    named = set(re.findall(r"LIGER_DDP_PATCH_[A-Z_]+", read(doc)))
    assert named <= known, f"{doc} names variables nothing reads: {sorted(named - known)}"


def test_settings_table_lists_every_user_variable():
    user, _ = known_variables()
    section = read("README.md").split("## Settings", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `(LIGER_DDP_PATCH_[A-Z_]+)`", section, flags=re.M))
    assert table == user, f"README Settings: missing {sorted(user - table)}, unknown {sorted(table - user)}"


def test_pending_variables_are_still_pending():
    """Once the loss settings land in environment.py, PENDING must shrink (then their parser is what is checked)."""
    package = {v for v in vars(environment).values() if isinstance(v, str) and v.startswith("LIGER_DDP_PATCH_")}
    assert not PENDING & package, f"now defined in environment.py: remove {sorted(PENDING & package)} from PENDING"


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_compile(doc):
    for block in fenced(read(doc), "python"):
        compile(block, doc, "exec")


# ------------------------------------------------------------------------------------------ links and names


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", prose, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    text = read(doc)
    base = (ROOT / doc).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else ROOT / doc
        assert file.exists(), f"{doc}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(file.read_text()), f"{doc}: link to {target}: no such heading"


@pytest.mark.parametrize("doc", ("README.md", "CONTRIBUTING.md"))
def test_named_tests_exist(doc):
    """Every ``tests/x.py::name`` (and a following ``::name``, same file) the docs cite is a real test."""
    cited = 0
    for line in read(doc).splitlines():
        current = None
        for file, name in re.findall(r"(tests/\w+\.py)?(?:::(\w+))?", line):
            if file:
                current = file
                assert (ROOT / file).exists(), f"{doc}: {file} does not exist"
            if name:
                assert current, f"{doc}: ::{name} without a file before it: {line}"
                source = read(current)
                assert re.search(rf"^def {name}\(", source, flags=re.M), f"{doc}: {current}::{name} is not a test"
                cited += 1
    assert cited >= (30 if doc == "README.md" else 3), f"{doc}: only {cited} tests found: is the extraction broken?"


def test_every_evidence_row_names_a_test_or_a_benchmark():
    section = read("README.md").split("## How we know", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| claim")]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3, row
        assert "tests/" in cells[1] or "benchmarks/" in cells[1], row


def test_first_screen_gets_a_user_to_it_is_on():
    lines = read("README.md").splitlines()
    at = {text: next(i for i, line in enumerate(lines) if line.startswith(text)) for text in
          ("## Am I affected?", "## Install", "## Turn it on", "import liger_ddp_patch")}  # fmt: skip
    assert list(at.values()) == sorted(at.values()), at
    assert at["import liger_ddp_patch"] < FIRST_SCREEN, at


# ------------------------------------------------------------------------------------------- generated tables


def _block(text: str, begin: str, end: str) -> str:
    start, stop = text.find(begin), text.find(end)
    assert 0 <= start < stop, f"lost the markers {begin!r}"
    return text[start : stop + len(end)] + "\n"


def test_affected_table_is_current():
    assert _block(read("README.md"), affected.BEGIN, affected.END) == affected.render(), (
        "README's affected table is stale: paste `python tests/affected.py` over it"
    )


def test_not_affected_list_is_current():
    assert _block(read("README.md"), affected.NOT_BEGIN, affected.NOT_END) == affected.render_not_affected(), (
        "README's not-affected list is stale: paste `python tests/affected.py not-affected` over it"
    )


def _rows_covering(kind: str, version: str) -> list[affected.Row]:
    from packaging.version import Version

    v = Version(version)
    return [
        r
        for r in affected.ROWS
        if kind in r.kinds
        and r.setup in (affected.DDP, affected.ANY)  # plain DDP, not a narrower setting of it
        and Version(r.first) <= v
        and (r.last is None or v <= Version(r.last))
    ]


def test_affected_rows_agree_with_the_package():
    """Each trainer spec has rows naming its patches; each patch a row names exists once its trainer has a spec;
    releases are ones we have read; under DDP, DPO/KTO's outcome per release is what the matrix observed."""
    specs = {s.name: s for s in SPECS}
    named = {p for r in affected.ROWS for p in r.patches}
    for spec in SPECS:
        assert spec.compute_loss_patch in named, f"{spec.trainer} has a spec but no row in tests/affected.py"
    for patch in named:
        if patch.split("_")[0] in specs:
            assert patch in NAMES, f"tests/affected.py names {patch}, which the package does not define"
    for r in affected.ROWS:
        assert r.first in tv.RELEASES and (r.last is None or r.last in tv.RELEASES), r
        assert r.outcome in (affected.SILENT, affected.CRASH, affected.FINE), r
        # a broken row names the patches that fix it, or says in bold that nothing does yet (and has no spec)
        unfixed = not r.kinds and r.does.startswith("**nothing yet**")
        assert bool(r.patches) == (r.outcome != affected.FINE and not unfixed), f"a broken row says what fixes it: {r}"
    outcome = {"unsynced": affected.SILENT, "crash": affected.CRASH, "synced": affected.FINE}
    for kind in ("dpo", "kto"):  # the trainers tests/matrix.py's LINES describe
        for version in tv.RELEASES:
            rows = _rows_covering(kind, version)
            assert len(rows) == 1, (kind, version, rows)
            assert rows[0].outcome == outcome[matrix.line_of(version).unpatched], (kind, version, rows[0])
            assert (rows[0].outcome != affected.FINE) == (version in tv.RELEASES[: tv.RELEASES.index(tv.FIXED_IN)])


# ----------------------------------------------------------------------- a README claim no other test pins


def test_nll_metric_is_zero_where_liger_gives_nan():
    """README "What changes in your run": without an NLL term our ``nll_loss`` output is 0 where Liger's is 0/0."""
    import torch
    from _loss_cases import IGNORE, leaf_copies, load_reference, make_inputs

    from liger_ddp_patch.losses import ChunkedDPOLoss

    inp = make_inputs(seed=3)
    pairs = inp["target"].shape[0] // 2
    inp["target"][:pairs] = IGNORE  # every chosen completion masked
    nll = {}
    for name, cls, extra in (
        ("ours", ChunkedDPOLoss, {}),
        ("liger", load_reference("dpo", "liger"), {"compiled": False}),
    ):
        if cls is None:
            pytest.skip("liger-kernel is not importable")
        x = leaf_copies(inp)
        _, metrics = cls(beta=0.2, **extra)(
            x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"]
        )
        nll[name] = metrics[4]
    assert torch.isnan(nll["liger"]), nll  # the control: Liger's 0/0
    assert nll["ours"].item() == 0.0, nll


# ------------------------------------------------------------------- the README's sample outputs are real


def _sample_after(marker: str) -> list[str]:
    """The lines of the first unlabelled fenced block after ``marker`` in the README."""
    text = read("README.md")
    at = text.index(marker)
    body = next(body for start, lang, body in blocks(text) if start > at and lang == "")
    assert body.strip(), marker
    return body.splitlines()


def test_rank_0_line_is_what_the_ddp_test_sees():
    from test_ddp import ANNOUNCED  # asserted there on a real 2-rank run, with torchrun's rank prefix

    (line,) = _sample_after("Rank 0 then prints")
    assert line == f"{ANNOUNCED} (TRL #7245)"


def test_desync_error_sample_is_what_the_verifier_raises():
    from liger_ddp_patch.verify import describe

    names = ["model.embed_tokens.weight", *(f"p{i}" for i in range(24))]
    real = "GradientDesyncError: " + describe(names, dict.fromkeys(range(25), [1]), 2, 0)
    (sample,) = _sample_after("# with the fix: silent\n```")
    at = 0
    for piece in sample.split("..."):
        at = real.find(piece.strip(), at)
        assert at >= 0, f"README's GradientDesyncError sample no longer matches the verifier at {piece!r}:\n{real}"


def test_status_sample_is_what_status_prints():
    """The sample is TRL 1.12.0's (the test extra's): run `liger-ddp-patch status` and compare it line for line."""
    from importlib.metadata import version

    if version("trl") != "1.12.0":
        pytest.skip("the README's status sample is TRL 1.12.0's")
    sample = _sample_after("## Reading `liger-ddp-patch status`")
    assert sample[0] == "$ liger-ddp-patch status"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_DDP_PATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "liger_ddp_patch", "status"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == sample[1:], "README's status sample is stale: paste `liger-ddp-patch status`"
