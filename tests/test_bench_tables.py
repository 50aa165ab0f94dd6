"""benchmarks/README.md's current tables say what the raw files they quote say.

Every table under "## Current figures" names where its numbers come from: a link into ``benchmarks/results/`` in
its caption (the text since the heading or table before it) or, in the whole-step table, in each row's ``raw`` cell.
Such a table is read back here, cell by cell, from that file: the JSON a run wrote (``bench_step.py --json``,
``gpu_check.py``, ``gpu_profile.py``) or the tables a run printed (``bench_losses.py``, ``bench_sweeps.py``), each
value rounded to the digits the README prints. A table without a raw file says "(no raw file kept)". No torch here:
plain ``json`` and ``re``, a few milliseconds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
README = BENCH / "README.md"
HISTORY = BENCH / "HISTORY.md"
NO_RAW = "(no raw file kept)"
LINK = re.compile(r"\]\((results/[^)\s]+)\)")


class Table:
    def __init__(self, line: int, caption: str, header: list[str], rows: list[tuple[int, list[str]]]):
        self.line, self.caption, self.header, self.rows = line, caption, header, rows

    def name(self) -> str:
        return f"benchmarks/README.md:{self.line} (| {' | '.join(self.header[:4])} | ...)"


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str, first_line: int = 1) -> list[Table]:
    """Markdown tables in ``text``, each with its caption: the lines since the last heading or table."""
    found, caption, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((first_line + j, split_row(lines[j])))
                j += 1
            found.append(Table(first_line + i, " ".join(" ".join(caption).split()), split_row(line), rows))
            caption, i = [], j
            continue
        caption = [] if line.startswith("#") else [*caption, line]
        i += 1
    return found


def current_tables() -> list[Table]:
    text = README.read_text()
    start = text.index("\n## Current figures\n")
    end = text.index("\n## ", start + 1)
    return tables(text[start:end], first_line=text[:start].count("\n") + 1)


def plain(cell: str) -> str:
    return cell.replace("*", "").strip()


def same(cell: str, value: float) -> bool:
    """``cell`` is ``value`` printed to the digits ``cell`` shows (``1,766``, ``0.37``, ``2.5e-5``)."""
    text = plain(cell).replace(",", "")
    if "e" in text:
        mantissa = text.split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return float(text) == float(f"{value:.{digits}e}")
    digits = len(text.split(".")[1]) if "." in text else 0
    return text == f"{value:.{digits}f}"


def prompt_of(cell: str) -> float:
    return float(cell.replace(" ", "").rstrip("%")) / 100


def source(table: Table, link: str, default: str | None = None) -> Path:
    path = BENCH / link
    if path.is_dir() and default:
        path = path / default
    assert path.exists(), f"{table.name()}: its raw file {link} does not exist"
    return path


class Mismatch(list):
    def cell(self, table: Table, line: int, key, column: str, cell: str, raw: Path, expected) -> None:
        shown = expected if isinstance(expected, str) else f"{expected!r}"
        self.append(
            f"benchmarks/README.md:{line}, row {key}, column {column!r}: the README says {cell!r}, "
            f"{raw.relative_to(ROOT)} says {shown}"
        )


# ------------------------------------------------------------------------ bench_step.py (--json) and its arms

ARMS = {
    "patched s (tok/s, GiB/rank)": "patched",
    "Liger-off": "off",
    "TRL 1.14": "trl114",
    "TRL 1.16": "trl116",
    "unpatched (broken)": "unpatched",
    "before autocast": "patched_noautocast",
    "KL logits (before)": "patched_fullkl",
    "one_pass=1": "patched_onepass",
}
RATIOS = {
    "patched/off time": "time/off",
    "patched/TRL 1.14 time": "time/trl114",
    "patched/off mem": "mem/off",
    "patched/TRL 1.14 mem": "mem/trl114",
    "patched/TRL 1.16 time": "time/trl116",
    "patched/TRL 1.16 mem": "mem/trl116",
    "patched/before": "time/patched_noautocast",
    "patched/before KL": "time/patched_fullkl",
    "patched/before KL mem": "mem/patched_fullkl",
    "patched/TRL 1.14 CPU s": "cpu/trl114",
    "patched/one_pass=1 time": "time/patched_onepass",
    "patched/one_pass=1 mem": "mem/patched_onepass",
}
STEP_KEYS = ("dtype", "trainer", "prompt", "L", "measured", "raw")
# a raw cell's second link, "[Liger-off](results/...)": Liger-off and the package ran in a run of their own there
OFF_LINK = re.compile(r"\[Liger-off\]\((results/[^)\s]+)\)")
OFF_COLUMNS = ("Liger-off", "patched/off time", "patched/off mem")
ARM_CELL = re.compile(r"\**([\d.,]+)\** \(([\d.,]+), ([\d.,]+)\)")


def step_rows(path: Path) -> list[dict]:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    rows = []
    for file in files:
        data = json.loads(file.read_text())
        if isinstance(data, dict) and "table" in data:
            rows += [{**row, "_file": file} for row in data["table"]]
    return rows


def check_step(table: Table, out: Mismatch) -> None:
    col = {name: i for i, name in enumerate(table.header)}
    unknown = [c for c in table.header if c not in (*STEP_KEYS, "tokens/step", *ARMS, *RATIOS)]
    assert not unknown, f"{table.name()}: no rule reads columns {unknown} from a bench_step.py JSON"
    links = LINK.findall(table.caption)
    for line, cells in table.rows:
        raw_cell = cells[col["raw"]] if "raw" in col else ""
        link = LINK.findall(raw_cell) or links
        if not link:
            assert NO_RAW in raw_cell or NO_RAW in table.caption, f"benchmarks/README.md:{line}: no raw file named"
            continue
        raw = source(table, link[0])
        trainer = cells[col["trainer"]]
        key = {"trainer": trainer, "prompt": prompt_of(cells[col["prompt"]]), "L": int(cells[col["L"]])}
        if "dtype" in col:
            key["dtype"] = cells[col["dtype"]]
        names = {trainer.split()[0].lower(), re.sub(r"\W+", "_", trainer.lower()).strip("_")}
        found = [
            r
            for r in step_rows(raw)
            if r["trainer"] in names
            and r["prompt"] == key["prompt"]
            and r["L"] == key["L"]
            and r["dtype"] == key.get("dtype", r["dtype"])
        ]
        assert len(found) == 1, (
            f"benchmarks/README.md:{line}: {len(found)} rows of {raw.relative_to(ROOT)} match {key} "
            "(link the one JSON file in the raw cell if several hold it)"
        )
        (main_row,) = found
        off_row = main_row
        for off_link in OFF_LINK.findall(raw_cell):
            same_row = ("trainer", "dtype", "prompt", "L")
            (off_row,) = [r for r in step_rows(source(table, off_link))
                          if all(r[k] == main_row[k] for k in same_row)]  # fmt: skip
        for name, i in col.items():
            cell = cells[i]
            json_row = off_row if name in OFF_COLUMNS else main_row
            raw = json_row["_file"]
            if name == "tokens/step":
                if not same(cell, json_row["tokens"]):
                    out.cell(table, line, key, name, cell, raw, json_row["tokens"])
            elif name in ARMS:
                arm = json_row["arms"].get(ARMS[name])
                if cell.startswith("not run"):
                    if arm and "s" in arm:
                        out.cell(table, line, key, name, cell, raw, f"a run of {ARMS[name]}: {arm['s']}")
                    continue
                match = ARM_CELL.fullmatch(cell)
                assert match, f"benchmarks/README.md:{line}, column {name!r}: cannot read {cell!r}"
                if arm is None:
                    out.cell(table, line, key, name, cell, raw, f"no arm {ARMS[name]}")
                    continue
                for text, field in zip(match.groups(), ("s", "tok_s", "peak_gib")):
                    if not same(text, arm[field]):
                        out.cell(table, line, key, f"{name}: {field}", text, raw, arm[field])
            elif name in RATIOS:
                value = json_row.get("ratios", {}).get(RATIOS[name])
                if plain(cell) == "-":
                    if value is not None:
                        out.cell(table, line, key, name, cell, raw, value)
                elif value is None:
                    out.cell(table, line, key, name, cell, raw, f"no ratio {RATIOS[name]}")
                elif not same(cell, value):
                    out.cell(table, line, key, name, cell, raw, value)


# --------------------------------------------------------------- bench_losses.py / bench_sweeps.py (printed)

LOSS_KEYS = ("loss", "dtype", "prompt", "B x L")
LOSS_COLUMNS = {"ours/two-pass time": "ours/before time"}  # the README's name: the printed table's name


def printed_loss_rows(path: Path) -> dict[tuple, dict[str, str]]:
    """Every row of every table ``bench_losses.py`` printed, by (loss, dtype, prompt, B x L), columns merged."""
    rows: dict[tuple, dict[str, str]] = {}
    for table in tables(path.read_text()):
        if tuple(table.header[:4]) != LOSS_KEYS:
            continue
        for _, cells in table.rows:
            key = (cells[0], cells[1], cells[2].replace(" ", ""), cells[3])
            rows.setdefault(key, {}).update(zip(table.header, cells))
    return rows


def check_losses(table: Table, raw: Path, out: Mismatch) -> None:
    rows = printed_loss_rows(raw)
    for line, cells in table.rows:
        key = (cells[0], cells[1], cells[2].replace(" ", ""), cells[3])
        assert key in rows, f"benchmarks/README.md:{line}: {raw.relative_to(ROOT)} has no row {key}"
        for name, cell in zip(table.header[4:], cells[4:]):
            printed = rows[key].get(LOSS_COLUMNS.get(name, name))
            assert printed is not None, f"{table.name()}: {raw.relative_to(ROOT)} printed no column {name!r}"
            if plain(cell) != printed:
                out.cell(table, line, key, name, cell, raw, repr(printed))


def check_sweeps(table: Table, raw: Path, out: Mismatch) -> None:
    text = raw.read_text()
    blocks = {}
    for match in re.finditer(r"^V=([\d,]+): one block of (\d+) x", text, flags=re.M):
        (printed,) = tables(text[match.end() :])[:1]
        blocks[match.group(1)] = (int(match.group(2)), {cells[0]: dict(zip(printed.header, cells)) for _, cells in
                                                        printed.rows})  # fmt: skip
    for line, cells in table.rows:
        key = cells[0]
        assert key in blocks, f"benchmarks/README.md:{line}: {raw.relative_to(ROOT)} has no V={key}"
        rows_in_block, arms = blocks[key]
        for name, cell in zip(table.header[1:], cells[1:]):
            if name == "block":
                if int(cell.split()[0].replace(",", "")) != rows_in_block:
                    out.cell(table, line, key, name, cell, raw, rows_in_block)
            elif name == "max diff vs now":
                worst = max(float(a["max abs diff vs now"]) for a in arms.values() if a["max abs diff vs now"] != "-")
                if float(cell.removeprefix("<=").strip()) != worst:
                    out.cell(table, line, key, name, cell, raw, worst)
            else:
                assert name in arms, f"{table.name()}: {raw.relative_to(ROOT)} has no arm {name!r}"
                match = re.fullmatch(r"([\d.]+)(?: \(([\d.]+)x\))?", cell)
                assert match, f"benchmarks/README.md:{line}, column {name!r}: cannot read {cell!r}"
                if match.group(1) != arms[name]["ms per block"]:
                    out.cell(table, line, key, name, cell, raw, arms[name]["ms per block"])
                if match.group(2) and match.group(2) != arms[name]["/ now"]:
                    out.cell(table, line, key, f"{name}: / now", cell, raw, arms[name]["/ now"])


# ---------------------------------------------------------------------------- gpu_check.py / gpu_profile.py

GPU_ARMS = {
    "ours": "ours",
    "ours, chunk L / 2": "ours_long",
    "ours, two-pass": "ours_2p",
    "Liger, compiled": "liger_c",
    "TRL 1.14": "trl114",
    "materialised": "mat",
    "patched": "patched",
    "Liger-off": "off",
}
GPU_LOSS = {
    "median ms": ("ms",),
    "peak MiB": ("peak_mib",),
    "err loss": ("err", "loss"),
    "err grad-hidden": ("err", "grad_h"),
    "err grad-weight": ("err", "grad_w"),
}
GPU_STEP = {
    "s/step": ("s",),
    "tokens/s": ("tok_s",),
    "peak GiB per rank": ("peak_gib",),
    "patched / arm time": ("patched_time",),
    "patched / arm memory": ("patched_mem",),
}
GPU_FLOOR = {"ours ms": ("ms", "ours"), "GEMM floor ms": ("ms", "gemm"), "ours/floor": ("ours_over_floor",)}


def dig(row: dict, path: tuple[str, ...]):
    for part in path:
        row = row[part]
    return row


def check_json_rows(table, raw, out, part: str, keys, match, columns) -> None:
    rows = json.loads(raw.read_text())[part]
    for line, cells in table.rows:
        key = tuple(cells[: len(keys)])
        found = [r for r in rows if match(r, key)]
        assert len(found) == 1, f"benchmarks/README.md:{line}: {len(found)} rows of {raw.relative_to(ROOT)} match {key}"
        for name, cell in zip(table.header[len(keys) :], cells[len(keys) :]):
            assert name in columns, f"{table.name()}: no rule reads column {name!r} from {raw.relative_to(ROOT)}"
            value = dig(found[0], columns[name])
            if not same(cell, value):
                out.cell(table, line, key, name, cell, raw, value)


def check_gpu_loss(table, raw, out):
    check_json_rows(table, raw, out, "a", ("prompt", "arm"),
                    lambda r, k: r["prompt"] == prompt_of(k[0]) and r["arm"] == GPU_ARMS[k[1]], GPU_LOSS)  # fmt: skip


def check_gpu_floor(table, raw, out):
    check_json_rows(table, raw, out, "a", ("loss", "prompt"),
                    lambda r, k: r["kind"] == k[0].lower() and r["prompt"] == prompt_of(k[1]), GPU_FLOOR)  # fmt: skip


def check_gpu_step(table, raw, out):
    check_json_rows(table, raw, out, "c", ("trainer", "arm"),
                    lambda r, k: r["trainer"] == k[0].lower() and r["arm"] == GPU_ARMS[k[1]], GPU_STEP)  # fmt: skip


# ------------------------------------------------------------------------------------ bench_verify.py (printed)


def check_verify_save(table, raw, out):
    """The checkpoint check's row: the line under ``median save`` that bench_verify.py printed."""
    lines = raw.read_text().splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("median save")]
    save, weights, share = re.findall(r"[\d.]+", lines[at + 1])[:3]
    ((line, cells),) = table.rows
    for name, cell, value in zip(table.header, cells, (save, weights, share)):
        if plain(cell).replace(" ", "").removesuffix("ms").removesuffix("%") != value:
            out.cell(table, line, "checkpoint", name, cell, raw, value)


def check_verify_digest(table, raw, out):
    """Issue 44's before/after rows: ``before (float sum), 1st`` is bench_verify_base_1.txt's printed save line."""
    for line, cells in table.rows:
        side = "base" if cells[0].startswith("before") else "main"
        nth = {"1st": 1, "2nd": 2, "3rd": 3}[cells[0].rsplit(", ", 1)[1]]
        printed = (raw / f"bench_verify_{side}_{nth}.txt").read_text().splitlines()
        (at,) = [i for i, text in enumerate(printed) if text.strip().startswith("median save")]
        for name, cell, value in zip(table.header[1:], cells[1:], re.findall(r"[\d.]+", printed[at + 1])[:3]):
            if plain(cell).replace(" ", "").removesuffix("ms").removesuffix("%") != value:
                out.cell(table, line, cells[0], name, cell, raw, value)


# ------------------------------------------------------------------------------ sim_gpu_peak.py (its rows' JSON)

SIM_ARMS = {"default": "ours", "one_pass=1": "ours_1p", "one_pass=0": "ours_2p", "TRL 1.14": "trl114",
            "TRL 1.16": "trl116", "Liger-off": "off"}  # fmt: skip
SIM_FREE = {"80 GB": "h100", "141 GB": "h200", "4 GiB": "full", "-": None}
SIM_KEYS = ("trainer", "L", "arm", "free", "rule")


def check_sim_peak(table, raw, out):
    """A simulated head-loss peak per row: the run's row of that trainer, length, arm, free memory and rule."""
    rows = json.loads(raw.read_text())["rows"]
    for line, cells in table.rows:
        key = tuple(plain(c) for c in cells[: len(SIM_KEYS)])
        trainer, L, arm, free, rule = key
        found = [r for r in rows if r["trainer"] == trainer.lower() and r["L"] == int(L.replace(",", ""))
                 and r["arm"] == SIM_ARMS[arm] and r.get("free_key") == SIM_FREE[free]
                 and r.get("rule", "-") == rule]  # fmt: skip
        assert len(found) == 1, f"benchmarks/README.md:{line}: {len(found)} rows of {raw.relative_to(ROOT)} match {key}"
        r = found[0]
        for name, cell in zip(table.header[len(SIM_KEYS) :], cells[len(SIM_KEYS) :]):
            if name == "path":
                value = {"one-pass": "one pass", "two-pass": "two passes"}.get(
                    (r.get("path") or "-").split(":")[0], "-"
                )
                ok = plain(cell) == value
            elif name == "chunk":
                value = r.get("chunk") or "-"
                ok = plain(cell) == (f"{value:,}" if value != "-" else "-")
            elif name == "sums":
                value = (r.get("held") or {}).get("vh_sums", "-")
                ok = plain(cell) == str(value)
            elif name == "peak GiB":
                value = r["peak"] / 2**30
                ok = same(cell, value)
            elif name == "CPU replay GiB":
                value = r["cpu_peak"] / 2**30
                ok = same(cell, value)
            else:
                continue  # prose (the sites at the peak)
            if not ok:
                out.cell(table, line, key, name, cell, raw, value)


def check_sim_capacity(table, raw, out):
    """The capacity rows: ``sim_gpu_peak.py --capacity``'s composition of the run's rows, recomputed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_gpu_peak as sim  # no torch at import: the composition is plain arithmetic

    rows = json.loads(raw.read_text())["rows"]
    for line, cells in table.rows:
        trainer, arm = plain(cells[0]).lower(), plain(cells[1])
        lines = sim.step_peak(rows, trainer).get(arm)
        assert lines, f"benchmarks/README.md:{line}: no simulated lines for {trainer} {arm} in {raw.relative_to(ROOT)}"
        limit = sim.capacity(lines, 80e9)
        a, b = lines["loss"]
        values = {"step peak at L=4,096, GiB": f"{(sim.STEP_BASE + sim.at(lines, 4096)) / sim.GIB:.2f}",
                  "longest L within 80 GB": f"{limit:,}",
                  "head-loss phase there, GiB": f"{(sim.STEP_BASE + a + b * limit) / sim.GIB:.1f}",
                  "lengths fitted": ", ".join(f"{n:,}" for n in lines["lengths"])}  # fmt: skip
        for name, cell in zip(table.header, cells):
            if name in values and plain(cell) != values[name]:
                out.cell(table, line, (trainer, arm), name, cell, raw, values[name])


# ----------------------------------------------------------------------------------------------------- tests

# (first header cells, the file a folder link means, checker); the step tables are checked row by row
CHECKERS = (
    (LOSS_KEYS, None, check_losses),
    (("V", "block"), None, check_sweeps),
    (("prompt", "arm", "median ms"), "gpu_check.json", check_gpu_loss),
    (("loss", "prompt", "ours ms"), "gpu_profile.json", check_gpu_floor),
    (("trainer", "arm", "s/step"), "gpu_check.json", check_gpu_step),
    (("median save (model + optimizer state)",), None, check_verify_save),
    (("run", "median save", "median weights check"), None, check_verify_digest),
    (SIM_KEYS, "sim_gpu_peak.json", check_sim_peak),
    (("trainer", "arm", "step peak at L=4,096, GiB"), "sim_gpu_peak.json", check_sim_capacity),
)


def is_step(table: Table) -> bool:
    return "trainer" in table.header and "patched s (tok/s, GiB/rank)" in table.header


def test_current_tables_name_their_source():
    found = current_tables()
    assert len(found) >= 10, f"only {len(found)} tables under ## Current figures: is the parser broken?"
    for table in found:
        sourced = LINK.search(table.caption) or (is_step(table) and "raw" in table.header)
        assert sourced or NO_RAW in table.caption, f"{table.name()}: link its raw file or say {NO_RAW!r}"


def test_current_tables_match_their_raw_files():
    out, checked = Mismatch(), 0
    for table in current_tables():
        if is_step(table):
            check_step(table, out)
            checked += 1
            continue
        links = LINK.findall(table.caption)
        if not links:
            continue
        rule = [(default, check) for head, default, check in CHECKERS if tuple(table.header[: len(head)]) == head]
        assert rule, f"{table.name()} links {links[-1]} but no rule here reads that file: add one"
        ((default, check),) = rule
        check(table, source(table, links[-1], default), out)
        checked += 1
    assert checked >= 8, f"only {checked} tables checked against raw files"
    assert not out, "benchmarks/README.md disagrees with its raw files:\n" + "\n".join(out)


def test_fp32_floor_ranges_match_their_raw_file():
    """The fp32 line under the bf16 floor table gives ranges, not a table: min and max of the printed rows."""
    text = README.read_text()
    number = r"(\d+\.\d+)"
    pattern = (rf"\[raw\]\((results/[^)]+fp32[^)]+\.txt)\)\): ours {number}-{number}x the floor, prev\s+{number}-"
               rf"{number}x, ours/prev {number}-{number}")  # fmt: skip
    match = re.search(pattern, text)
    assert match, "benchmarks/README.md lost its fp32 line (ours x-yx the floor, prev ..., ours/prev ...)"
    rows = printed_loss_rows(BENCH / match.group(1)).values()
    for column, (low, high) in zip(("ours/GEMM floor", "prev/GEMM floor", "ours/prev"),
                                   zip(match.groups()[1::2], match.groups()[2::2])):  # fmt: skip
        values = [r[column] for r in rows if column in r]
        assert (low, high) == span(values), f"fp32 line, {column}: README {low}-{high}, raw {sorted(values)}"


def span(printed: list[str]) -> tuple[str, str]:
    """The smallest and the largest of printed numbers, as printed: by value (as strings, "10.2" < "9.5")."""
    ordered = sorted(printed, key=float)
    return ordered[0], ordered[-1]


@pytest.mark.parametrize("printed, expected", [(["9.95", "10.02", "1.05"], ("1.05", "10.02")),
                                               (["0.99", "1.05", "1.00"], ("0.99", "1.05"))])  # fmt: skip
def test_span_orders_by_value_not_by_text(printed, expected):
    """A range past 10 (a 10.02x ratio) sorts before 9.95 as text: the fp32 line's check must not read it so."""
    assert span(printed) == expected


def test_history_is_linked_from_the_top_and_its_links_resolve():
    top = "\n".join(README.read_text().splitlines()[:12])
    assert "](HISTORY.md)" in top, "benchmarks/README.md should link HISTORY.md from its opening lines"
    text = HISTORY.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (BENCH / path).resolve() if path else HISTORY
        assert file.exists(), f"benchmarks/HISTORY.md: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(file.read_text()), f"benchmarks/HISTORY.md: link to {target}: no such heading"


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a document's headings (as tests/test_docs.py computes them)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", prose, flags=re.M)
    }


@pytest.mark.parametrize("cell, value, ok", [("**0.37**", 0.3712, True), ("1,766", 1766.2, True),
                                             ("2.5e-5", 2.4828e-05, True), ("0.37", 0.376, False)])  # fmt: skip
def test_same_rounds_as_printed(cell, value, ok):
    assert same(cell, value) is ok


# ------------------------------------------------- the README's whole-step table and figure (benchmarks/_table_step)

sys.path.insert(0, str(BENCH))
import _table_step  # noqa: E402

TOP_README = ROOT / "README.md"


def test_readme_step_table_is_what_the_raw_files_say():
    """The README's table is ``_table_step.table()`` read from the raw files now: edit a cell, or a raw file, or a
    spec, without regenerating (``python3 benchmarks/plot_step.py --table``) and this fails."""
    text = TOP_README.read_text()
    start, stop = text.find(_table_step.BEGIN), text.find(_table_step.END)
    assert 0 <= start < stop, f"README.md lost the markers {_table_step.BEGIN!r}"
    assert text[start : stop + len(_table_step.END)] == _table_step.table(), (
        "README.md's step table is stale: paste `python3 benchmarks/plot_step.py --table` between its markers"
    )


def test_readme_simulated_gpu_step_is_what_the_simulation_says():
    """The README's simulated GPU row (issue 45 item 6) is ``_table_step.sim_table()`` from sim_gpu_peak.py's rows."""
    text = TOP_README.read_text()
    start, stop = text.find(_table_step.SIM_BEGIN), text.find(_table_step.SIM_END)
    assert 0 <= start < stop, f"README.md lost the markers {_table_step.SIM_BEGIN!r}"
    assert text[start : stop + len(_table_step.SIM_END)] == _table_step.sim_table(), (
        "README.md's simulated GPU step differs from the simulation: python3 benchmarks/plot_step.py --table"
    )


def test_step_figure_is_drawn_from_the_raw_files():
    """The PNG carries the numbers it drew (its Description chunk, written by plot_step.py); they must be what the
    raw files give now, and the README must show it. Regenerate with ``python3 benchmarks/plot_step.py``."""
    figure = ROOT / _table_step.FIGURE
    assert figure.exists(), f"{_table_step.FIGURE} missing: python3 benchmarks/plot_step.py"
    drawn = json.loads(_table_step.png_text(figure).get("Description", "null"))
    assert drawn == _table_step.figure_data(), f"{_table_step.FIGURE} is stale: python3 benchmarks/plot_step.py"
    assert f"]({_table_step.FIGURE})" in TOP_README.read_text(), f"README.md does not show {_table_step.FIGURE}"
    assert all(r["time"] > 0 and r["peak"] > 0 for d in drawn for r in d["ratios"].values())
    assert len(drawn) == len(_table_step.SPECS) and all("TRL 1.14" in d["ratios"] for d in drawn)


def _whole_step_raw() -> dict[tuple, str]:
    """benchmarks/README.md's current whole-step rows at 50 % prompt that link a raw file: (dtype, trainer, L) ->
    the link (a file or a folder under results/)."""
    (table,) = [t for t in current_tables() if is_step(t) and "tokens/step" in t.header and "dtype" in t.header]
    col = {name: i for i, name in enumerate(table.header)}
    out = {}
    for _, cells in table.rows:
        link = LINK.findall(cells[col["raw"]])
        if link and prompt_of(cells[col["prompt"]]) == 0.5:
            out[(cells[col["dtype"]], cells[col["trainer"]].lower(), int(cells[col["L"]]))] = link[0]
    return out


def test_step_specs_are_the_current_cpu_rows():
    """The README's CPU rows are exactly benchmarks/README.md's current 50 % prompt rows with a raw file, each read
    from the file that row links: a new measurement replacing a row there must be a spec here too."""
    current = _whole_step_raw()
    specs = {(s.dtype, s.trainer, s.L): s.raw for s in _table_step.SPECS if s.raw.startswith("cpu-")}
    assert specs.keys() == current.keys(), f"specs {sorted(specs)} != benchmarks/README.md's {sorted(current)}"
    for key, raw in specs.items():
        link = current[key].removeprefix("results/").rstrip("/")
        assert raw == link or raw.startswith(link + "/"), f"{key}: spec reads {raw}, benchmarks/README.md links {link}"


def test_step_specs_read_the_gpu_step_benchmarks_readme_quotes():
    (gpu,) = [t for t in current_tables() if tuple(t.header[:3]) == ("trainer", "arm", "s/step")]
    linked = LINK.findall(gpu.caption)[-1].removeprefix("results/")
    for spec in (s for s in _table_step.SPECS if not s.raw.startswith("cpu-")):
        assert spec.raw == linked or spec.raw == f"{linked.rstrip('/')}/gpu_check.json", (spec.raw, linked)


def _row(trainer, time_trl, mem_trl, off=(None, None), setup="CPU x", L=512, note=""):
    return _table_step.Row(setup, trainer, L, "M", "2026-12-07", note, "r.json", 1.0, 2.0, None, None, 1.0, 2.0,
                           off[0], off[1], time_trl, mem_trl)  # fmt: skip


def test_step_table_pairs_trainers_and_marks_misses():
    """Made-up rows: DPO and KTO of one configuration share a line; a missing trainer or arm is "—"; a ratio that
    prints over 1.00 is bold (1.004 prints 1.00: not bold); another configuration is its own line."""
    table = _table_step.table([_row("DPO", 0.5, 1.004, off=(0.4, 0.3)), _row("KTO", 1.2, 0.9),
                               _row("KTO", 0.8, 1.1, L=2048, note="old")])  # fmt: skip
    lines = table.splitlines()[3:-1]
    assert lines == [
        "| CPU x | 512 | 1.00 / 1.00 | 0.40 / — | 0.50 / **1.20** | 2.00 / 2.00 | 0.30 / — | 1.00 / 0.90 "
        "| M, 2026-12-07 |",
        "| CPU x | 2,048 | — / 1.00 | — / — | — / 0.80 | — / 2.00 | — / — | — / **1.10** | M, 2026-12-07: old |",
    ]


def test_step_table_puts_a_newer_upgrade_beside_trl_1_14(tmp_path):
    """Issue 45: a raw file that also ran ``trl116`` (TRL 1.16) gives its rows that release's ratios, and the table a
    ``÷ TRL 1.16`` column after each ``÷ TRL 1.14`` (bold over 1.00; "—" where a row did not run it); rows without it
    keep today's columns."""
    arm = dict(s=2.0, peak_gib=3.0)
    row = dict(trainer="dpo", dtype="bf16", prompt=0.5, L=512, arms=dict(patched=arm, trl114=arm, trl116=arm),
               ratios={"time/trl114": 0.8, "mem/trl114": 0.9, "time/trl116": 1.3, "mem/trl116": 0.95})  # fmt: skip
    header = "2026-12-08 01:00 UTC  AMD EPYC (torch AVX512, bf16 GEMM AVX-512 BF16)  2 CPUs"
    (tmp_path / "step.json").write_text(json.dumps(dict(header=header, table=[row, dict(row, trainer="kto")])))
    specs = [_table_step.Spec("step.json", "dpo", "bf16", 512), _table_step.Spec("step.json", "kto", "bf16", 512)]
    found = _table_step.rows(specs, tmp_path)
    assert found[0].newer == (("TRL 1.16", 2.0, 3.0, 1.3, 0.95),)
    lines = _table_step.table([found[0], _row("KTO", 0.8, 0.9, setup="CPU bf16")]).splitlines()
    assert "| ÷ TRL 1.14 | ÷ TRL 1.16 | peak GiB/rank | ÷ Liger-off | ÷ TRL 1.14 | ÷ TRL 1.16 | measured |" in lines[1]
    assert lines[3].startswith("| CPU bf16 | 512 | 2.00 / 1.00 | — / — | 0.80 / 0.80 | **1.30** / — | 3.00 / 2.00 |")
    assert "| 0.90 / 0.90 | 0.95 / — |" in lines[3]
    assert "TRL 1.16" not in _table_step.table([_row("DPO", 0.8, 0.9)])  # no row ran it: today's columns


@pytest.mark.parametrize("header, expected", [
    ("2026-12-06 06:29 UTC  Intel(R) Xeon(R) Processor (torch AVX512, bf16 GEMM AMX)  2 CPUs", ("Intel Xeon AMX",
     "2026-12-06")),
    ("2026-12-05 21:58 UTC  AMD EPYC (torch AVX512, bf16 GEMM AVX-512 BF16)  2 CPUs", ("AMD EPYC AVX-512 BF16",
     "2026-12-05")),
    ("2026-12-04 18:29 UTC  AMD EPYC (torch AVX2, bf16 GEMM emulated: bf16 rows are GEMM-bound here)  2 CPUs",
     ("AMD EPYC AVX2", "2026-12-04")),
])  # fmt: skip
def test_machine_named_from_bench_step_header(header, expected):
    assert _table_step.machine(header) == expected


def test_step_peak_replays_back_the_readmes_same_bytes():
    """README.md: "A CPU peak of 0.99-1.01x TRL 1.14's is the same bytes: both steps peak in the embedding's
    backward". benchmarks/README.md quotes the replayed peaks (``BENCH_STEP_MEMORY``, rank 0) of each pair of arms;
    they must be what the raw files say, equal to 0.01 %, and reached at the same site."""
    text = (BENCH / "README.md").read_text()
    found = BENCH.glob("results/*/step_peak_by_site/*_patched.memory.json")
    pairs = sorted({(p.parent, p.name.split("_patched")[0]) for p in found})
    assert len(pairs) >= 5, f"only {len(pairs)} replayed pairs under benchmarks/results/*/step_peak_by_site"
    for folder, pair in pairs:
        ours, trl = (json.loads((folder / f"{pair}_{arm}.memory.json").read_text()) for arm in ("patched", "trl114"))
        assert abs(ours["peak"] - trl["peak"]) <= 1e-4 * trl["peak"], (pair, ours["peak"], trl["peak"])
        assert ours["at"] == trl["at"] and "backward" in ours["at"], (pair, ours["at"], trl["at"])
        for peak in (ours["peak"], trl["peak"]):
            assert f"{peak:,} B" in text, f"benchmarks/README.md does not quote {pair}'s replayed peak {peak:,} B"
