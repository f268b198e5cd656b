"""Every fenced code block of README.md runs, at tiny sizes, or is accounted for with a reason.

A block is known by its section (the nearest heading above it) and its ordinal there:
``"Real data#0"``. :data:`BLOCKS` says how each one is checked, and a block it does not name
fails :func:`test_every_readme_block_is_accounted_for`:

- ``shell``: the block runs through ``bash -e -o pipefail`` in a fresh directory, with the
  running venv's ``bin`` (the ``dapple`` console script) first on PATH and the Hugging Face hub
  offline. A ``prelude`` first makes the files a reader is assumed to have (a ``plan.json`` for
  the block's model, a ``book.txt``); ``shrink`` substitutions make long runs short, and each must
  match exactly once, so a README edit cannot silently stop the shrinking. Commands within a
  block run in order in one directory; no block reads files another block wrote.
- ``python``: the block runs as a script (the workers it starts import it).
- ``ci``: the lint + test command: CI runs it verbatim (``.ci/run``); inside the suite it would
  run the suite, so the fast tier checks it against ``.ci/run`` and ``pyproject.toml``.
- ``output``: not a command; its ``check`` compares what it shows with the source tree.

Blocks that finish in seconds run in the fast tier, and so do the first ``quick_lines`` of a
slower one; multi-process training and long searches run in the slow tier. Every ``dapple`` command line of every block is also parsed by the CLI's own parser in the fast
tier, so a renamed flag or choice fails without running anything.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the venv running the tests: `dapple` is installed beside it

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S*)")  # indented too (in a list item)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


# -- the blocks ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: ``key`` is ``"{section}#{ordinal within the section}"``."""

    section: str
    ordinal: int
    lang: str  # the fence's info string: "bash", "python" or "" for a plain fence
    line: int  # 1-based line of the opening fence
    text: str

    @property
    def key(self) -> str:
        return f"{self.section}#{self.ordinal}"


def extract_blocks(markdown: str) -> list[Block]:
    """Every fenced block of ``markdown`` in order, with the heading it sits under.

    Raises:
        ValueError: a fence is never closed.
    """
    blocks: list[Block] = []
    section, ordinal = "", 0
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        heading = _HEADING.match(lines[i])
        if opening:
            fence, start = opening.group(1), i
            i += 1
            while i < len(lines) and lines[i].strip() != fence:
                i += 1
            if i == len(lines):
                raise ValueError(f"README line {start + 1}: fence {fence} is never closed")
            body = textwrap.dedent("\n".join(lines[start + 1 : i]) + "\n")
            blocks.append(Block(section, ordinal, opening.group(2), start + 1, body))
            ordinal += 1
        elif heading:
            section, ordinal = heading.group(1), 0
        i += 1
    return blocks


@dataclasses.dataclass(frozen=True, kw_only=True)
class Way:
    """How one README block is checked."""

    how: str  # "shell" | "python" | "ci" | "output"
    lang: str  # the fence language the block must keep
    why: str  # what the block is; for anything not run as written, why
    slow: bool = True  # multi-process or long: the slow tier
    quick_lines: int = 0  # of a slow block: its first lines, quick commands, also run fast
    timeout_s: int = 600  # for the block's process, on a loaded 2-core machine
    prelude: str = ""  # shell lines making the files a reader is assumed to have
    shrink: tuple[tuple[str, str], ...] = ()  # (README text, what runs instead), each once
    needs: tuple[str, ...] = ()  # modules of optional extras the block imports
    expect: tuple[str, ...] = ()  # text the run prints (stdout and stderr together)
    files: tuple[str, ...] = ()  # files the run leaves in its directory
    check: Callable[[Path, str], None] | None = None
    """More checks: on (its directory, its output) for a block that runs, on (the repository,
    the block's text) for an output block."""


def _plan(layers: int, cut: int, name: str = "plan.json") -> str:
    """A prelude line writing a 2:1 pipeline plan (3 processes), in the README's own idiom."""
    return (
        'python -c "from dapple.core.plan import straight_plan as p; '
        f"p({layers}, [0, {cut}], global_batch_size=4, num_micro_batches=2, replicas=[2, 1])"
        f".save('{name}')\"\n"
    )


PLAN_FOR_MLP = _plan(5, 3)  # the zoo mlp has 5 layers
PLAN_FOR_TRANSFORMER = _plan(8, 4)  # the zoo transformer has 8


def _check_keep(work: Path, out: str) -> None:
    kept = sorted(p.name for p in (work / "ckpt").glob("step-*"))
    assert kept == ["step-00000004", "step-00000006", "step-00000008"], kept  # --keep 3 of 4


def _check_eval_run(work: Path, out: str) -> None:
    rows = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1], rows
    assert all(r.get("eval_loss") is not None for r in rows), rows  # --eval-every 1 (shrunk)
    assert any((work / "tb").rglob("events.out.tfevents.*")), "no TensorBoard events in tb/"


def _check_best_plan(work: Path, out: str) -> None:
    plan = json.loads((work / "best.json").read_text())  # the README says: zbv 8:8 M=8
    assert (plan["schedule"], plan["replication"], plan["num_micro_batches"]) == ("zbv", "8:8", 8)


def _check_run_file(root: Path, text: str) -> None:
    """The config-file example reads as a run file, a plan file and a simulation's file, every
    key as given."""
    from dapple.api.run_config import load_run_config
    from dapple.api.simulating import load_simulate_config
    from dapple.planner.plan_config import load_plan_config

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.toml"
        path.write_text(text)
        run, plan, sim = load_run_config(path), load_plan_config(path), load_simulate_config(path)
    assert (run.model.spec, run.train.lr, run.run.keep) == ("transformer", 3e-4, 3)
    assert (plan.global_batch_size, plan.zero_stage) == (32, "auto")
    assert (sim.plan, sim.cluster, sim.gantt) == ("plan.json", "local-cpu", "gantt.png")


def _check_tree(root: Path, text: str) -> None:
    """The architecture tree names every package and module of src/dapple, each once, in the
    order of the import-linter layers (top to bottom)."""
    listed = re.findall(r"^  ([a-z_]+)(?:/|\.py)\s", text, re.M)
    src = root / "src" / "dapple"
    present = sorted(
        p.stem
        for p in src.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file())
        or (p.suffix == ".py" and not p.name.startswith("_"))
    )
    assert sorted(listed) == present, (listed, present)
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    layers = pyproject["tool"]["importlinter"]["contracts"][0]["layers"]
    rank = {name.strip(): r for r, layer in enumerate(layers) for name in layer.split("|")}
    ranks = [rank[name] for name in listed if name in rank]
    assert ranks == sorted(ranks), f"the tree is not in the import-linter layers' order: {listed}"


_SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
"""The first block's set-up: the tests already run in the venv it makes; checked against CI in
:func:`test_the_setup_commands_are_the_ones_ci_runs`."""

BLOCKS: dict[str, Way] = {
    "Two commands#0": Way(
        how="shell", lang="bash",
        why="set-up, then the end-to-end demo: the set-up is CI's (checked), the demo runs shrunk "
            "to the sizes tests/test_demo.py uses",
        timeout_s=840,
        shrink=(
            (_SETUP, ""),
            ("dapple demo", "dapple demo --steps 12 --corpus-mib 0.3"),
        ),
        expect=("demo: every check passed in",),
        files=("out/demo/summary.json", "out/demo/loss.png"),
    ),
    "Two commands#1": Way(
        how="ci", lang="bash",
        why="lint, types and the fast tier: .ci/run runs it verbatim; run here it would "
            "recurse into this test",
    ),
    "Architecture#0": Way(
        how="output", lang="",
        why="the package tree, not a command", check=_check_tree,
    ),
    "Config files#0": Way(
        how="output", lang="toml",
        why="a run file, not a command: read as dapple train and dapple plan read it",
        check=_check_run_file,
    ),
    "Python API#0": Way(
        how="python", lang="python",
        why="the Python API on a 2-layer GPT-2: load, profile, plan, simulate, train, verify",
        timeout_s=840, needs=("transformers",),
        expect=("step 9 ",),  # echo=True printed every step
    ),
    "Large models, your own weights in and out#0": Way(
        how="shell", lang="bash",
        why="pretrained LLaMA in, trained weights out; already tiny",
        needs=("transformers", "safetensors"),
        expect=("weights loaded: ", "LlamaForCausalLM("),
        files=("prof.json", "plan.json", "trained/config.json", "trained/model.safetensors"),
    ),
    "The 3-D plan space: tensor parallelism and ZeRO-3#0": Way(
        how="shell", lang="bash",
        why="analytic Llama-3 8B planned on 16 H100 with per-stage widths, drawn; already quick",
        expect=("tensor width", "wrote plan_3d.png"),
        files=("llama8b.json", "plan.json", "plan_3d.png"),
    ),
    "Long runs#0": Way(
        how="shell", lang="bash",
        why="checkpointed mlp run: needs the reader's plan.json",
        prelude=PLAN_FOR_MLP,
        shrink=(("--steps 1000", "--steps 8"), ("--save-every 100", "--save-every 2")),
        expect=("step 7 ",),
        check=_check_keep,
    ),
    "Long runs#1": Way(
        how="shell", lang="bash",
        why="an elastic run (nothing lost here: it trains); self-contained",
        shrink=(("--steps 200", "--steps 3"),),
        expect=("step 2 ",),
        files=("ck/step-00000003/manifest.json",),
    ),
    "Real data#0": Way(
        how="shell", lang="bash",
        why="prepare a text file, train on it: needs the reader's book.txt (this README) and "
            "plan.json",
        prelude=f"cp {shlex.quote(str(README))} book.txt\n" + PLAN_FOR_TRANSFORMER,
        shrink=(("--steps 1000", "--steps 2"),),
        expect=("step 1 ",),
        files=("data/train.bin", "data/val.bin", "data/meta.json"),
    ),
    "Shapes that change from step to step#0": Way(
        how="shell", lang="bash",
        why="verify a 3:1 plan on changing lengths; self-contained",
        expect=("OK: largest gradient difference",),
    ),
    "Variable-length documents#0": Way(
        how="shell", lang="bash",
        why="documents padded (verify) and packed (train); self-contained",
        expect=("OK: largest gradient difference", "step 19 "),
        files=("docs/train.docs.npy", "docs/val.bin"),
    ),
    "Cost and memory by length#0": Way(
        how="shell", lang="bash",
        why="profile at three lengths, plan for a length distribution, verify; self-contained",
        expect=("OK: largest gradient difference",),
        files=("lm-prof.json", "lm-plan.json"),
    ),
    "Evaluation and what a run shows#0": Way(
        how="shell", lang="bash",
        why="evaluation, metrics, TensorBoard and the loss curve: needs the reader's plan.json",
        prelude=PLAN_FOR_TRANSFORMER,
        shrink=(("--steps 1000", "--steps 2"), ("--eval-every 100", "--eval-every 1")),
        needs=("tensorboard",),
        files=("loss.png",),
        check=_check_eval_run,
    ),
    "Optimisation#0": Way(
        how="shell", lang="bash",
        why="AdamW, warm-up + cosine, clipping: needs the reader's plan.json",
        prelude=PLAN_FOR_MLP,
        shrink=(("--steps 1000", "--steps 4"), ("--warmup-steps 100", "--warmup-steps 2")),
        expect=("step 3 ",),
    ),
    "Sharded training state (ZeRO-1/2 per stage)#0": Way(
        how="shell", lang="bash",
        why="ZeRO plan, train and verify (8 processes): needs the reader's prof.json of the mlp",
        prelude="dapple profile -m mlp --batch-sizes 1,2,4 --device cpu -o prof.json\n",
        expect=("OK: largest gradient difference",),
    ),
    "Schedules#0": Way(
        how="shell", lang="bash",
        why="plan and simulate the paper's BERT-48 under each schedule; no training, but "
            "its --compare and --schedule best searches take 10-20 s: slow tier, its first two "
            "commands fast",
        timeout_s=300, quick_lines=2,
        expect=("chosen: zbv",),
        files=("zb.json",),
        check=_check_best_plan,
    ),
}  # fmt: skip


def _block(key: str) -> Block:
    found = [b for b in extract_blocks(README.read_text()) if b.key == key]
    assert found, f"README.md has no block {key!r}"
    return found[0]


def unaccounted(blocks: list[Block], ways: dict[str, Way]) -> list[str]:
    """What keeps the README and :data:`BLOCKS` from naming the same blocks (empty when they do)."""
    keys = [b.key for b in blocks]
    problems = [
        f"line {b.line}: block {b.key!r} ({b.lang or 'plain'}) is not in BLOCKS: run it there, "
        "or classify it with a reason"
        for b in blocks
        if b.key not in ways
    ]
    problems += [
        f"BLOCKS names {k!r}, which README.md no longer has" for k in ways if k not in keys
    ]
    problems += [
        f"line {b.line}: block {b.key!r} is ```{b.lang}, BLOCKS expects ```{ways[b.key].lang}"
        for b in blocks
        if b.key in ways and ways[b.key].lang != b.lang
    ]
    return problems


def shrink(text: str, substitutions: tuple[tuple[str, str], ...]) -> str:
    """``text`` with each substitution made; each must match exactly once.

    Raises:
        AssertionError: a substitution matches zero or several times.
    """
    for old, new in substitutions:
        n = text.count(old)
        assert n == 1, f"substitution {old!r} -> {new!r} matches {n} times, not once:\n{text}"
        text = text.replace(old, new)
    return text


# -- running -------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(BIN.parent),
        "HF_HUB_OFFLINE": "1",  # never download: models come from configs or local files
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
    }


def run_command(argv: list[str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` in its own session; on timeout kill the whole group and fail."""
    with subprocess.Popen(
        argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"{argv} ran past {timeout_s} s:\n{out[-4000:]}") from None
    return proc.returncode, out


def run_block(block: Block, way: Way, work: Path) -> str:
    """Run one shell or python block in ``work`` as :data:`BLOCKS` says; return its output.

    Raises:
        AssertionError: the block fails, or leaves out what ``way`` expects.
    """
    body = shrink(block.text, way.shrink)
    if way.how == "shell":
        script = work / "readme_block.sh"
        script.write_text(way.prelude + body)
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
    else:
        assert way.how == "python" and not way.prelude, way
        script = work / "readme_block.py"
        script.write_text(body)
        argv = [str(BIN / "python"), str(script)]
    rc, out = run_command(argv, work, way.timeout_s)
    where = f"README.md line {block.line} ({block.key}), run as:\n{script.read_text()}\n"
    assert rc == 0, f"{where}exit {rc}:\n{out[-6000:]}"
    for text in way.expect:
        assert text in out, f"{where}{text!r} not in its output:\n{out[-6000:]}"
    for name in way.files:
        assert (work / name).is_file(), f"{where}it left no {name}"
    if way.check:
        way.check(work, out)
    return out


def _params(slow: bool) -> list[object]:
    """The slow tier runs slow blocks whole; the fast tier runs quick blocks whole and the
    ``quick_lines`` of slow ones."""
    tier = [pytest.mark.slow] if slow else []
    return [
        pytest.param(key, id=key, marks=[*tier, pytest.mark.timeout(way.timeout_s + 60)])
        for key, way in BLOCKS.items()
        if way.how in ("shell", "python")
        and (way.slow if slow else (not way.slow or way.quick_lines > 0))
    ]


@pytest.mark.parametrize("key", _params(slow=False))
def test_readme_block_runs_quickly(key: str, tmp_path: Path) -> None:
    """A quick block, or the first ``quick_lines`` of a slow one (no expectations: those are
    the whole block's)."""
    way, block = BLOCKS[key], _block(key)
    if way.slow:
        lines = shrink(block.text, way.shrink).splitlines(keepends=True)[: way.quick_lines]
        assert not lines[-1].rstrip().endswith("\\"), f"{key}: quick_lines cuts a command"
        block = dataclasses.replace(block, text="".join(lines))
        way = Way(
            how=way.how, lang=way.lang, why=way.why, timeout_s=way.timeout_s,
            prelude=way.prelude, needs=way.needs,
        )  # fmt: skip
    for module in way.needs:
        pytest.importorskip(module)
    run_block(block, way, tmp_path)


@pytest.mark.parametrize("key", _params(slow=True))
def test_readme_block_runs(key: str, tmp_path: Path) -> None:
    way = BLOCKS[key]
    for module in way.needs:
        pytest.importorskip(module)
    run_block(_block(key), way, tmp_path)


# -- what the fast tier checks of every block ------------------------------------------------------
def test_every_readme_block_is_accounted_for() -> None:
    blocks = extract_blocks(README.read_text())
    assert len(blocks) >= len(BLOCKS) > 0
    assert unaccounted(blocks, BLOCKS) == []
    for key, way in BLOCKS.items():
        assert way.how in ("shell", "python", "ci", "output") and way.why, key
        assert way.how != "output" or way.check, f"{key}: an output block needs a check"
        assert not way.quick_lines or way.slow, f"{key}: quick_lines is for slow blocks"


def test_every_substitution_still_matches_once() -> None:
    for key, way in BLOCKS.items():
        shrink(_block(key).text, way.shrink)


def test_output_blocks_match_the_source() -> None:
    for key, way in BLOCKS.items():
        if way.how == "output":
            assert way.check, key
            way.check(ROOT, _block(key).text)


def test_the_setup_commands_are_the_ones_ci_runs() -> None:
    """CI (``.ci/run``) runs the README's second block verbatim; the first block sets up the same
    way without the dev and hf extras; the extras exist and install the tools the block names."""
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    ci = _block("Two commands#1").text.strip()
    assert ci == ci_lines[-1], (ci, ci_lines[-1])
    steps = ci.split(" && ")
    assert steps[:3] == [
        "python3 -m venv .venv", ". .venv/bin/activate", "pip install -q -e '.[dev,hf]'"
    ]  # fmt: skip
    demo_setup = _SETUP.split(" && ")[:3]
    assert demo_setup == [steps[0], steps[1], "pip install -e ."]
    assert _block("Two commands#0").text.startswith(_SETUP)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"dev", "hf"} <= extras.keys()
    dev = " ".join(extras["dev"])
    tools = {"ruff": "ruff", "mypy": "mypy", "lint-imports": "import-linter", "pytest": "pytest"}
    assert {step.split()[0] for step in steps[3:]} == tools.keys()
    for tool, package in tools.items():
        assert package in dev, f"the dev extra does not install {package}"
        assert (BIN / tool).is_file(), f"{tool} is not installed in {BIN}"


# -- every `dapple` command line, parsed by the CLI's parser ---------------------------------------
def dapple_commands(text: str) -> list[list[str]]:
    """The arguments of every ``dapple ...`` command of a shell block, with ``NAME="..."``
    assignments of the block expanded where ``$NAME`` is used."""
    variables: dict[str, list[str]] = {}
    commands: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # a line inside a multi-line quoted string (python -c "...")
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                if len(command) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                    name, value = command[0].split("=", 1)
                    variables[name] = shlex.split(value)
                elif command[:1] == ["dapple"]:
                    commands.append(command[1:])
                command = []
            elif word.startswith("$") and word[1:] in variables:
                command += variables[word[1:]]
            else:
                command.append(word)
    return commands


def parse_error(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """What ``dapple`` says of ``argv`` before running anything (None: it parses)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def test_every_dapple_command_in_the_readme_parses() -> None:
    from dapple.cli import build_parser

    parser = build_parser()
    failures, seen = [], 0
    for block in extract_blocks(README.read_text()):
        if block.key not in BLOCKS or BLOCKS[block.key].how not in ("shell", "ci"):
            continue
        commands = dapple_commands(block.text)
        has_dapple = re.search(r"(^|&& )dapple [a-z]", block.text, re.M)
        assert bool(commands) == bool(has_dapple), (block.key, commands)
        for argv in commands:
            seen += 1
            error = parse_error(argv, parser)
            if error:
                failures.append(
                    f"line {block.line} ({block.key}): dapple {shlex.join(argv)}: {error}"
                )
    assert seen >= 20, seen
    assert failures == []


def api_call_errors(source: str) -> list[str]:
    """What is wrong with the calls a Python block makes through ``import MODULE as NAME``: a
    function the module lacks, or arguments its signature does not take."""
    tree = ast.parse(source)
    modules = {
        alias.asname or alias.name: importlib.import_module(alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    errors: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in modules
        ):
            continue
        name = f"{node.func.value.id}.{node.func.attr}"
        fn = getattr(modules[node.func.value.id], node.func.attr, None)
        if fn is None:
            errors.append((node.lineno, f"line {node.lineno}: {name} does not exist"))
            continue
        args = [None] * len(node.args)
        kwargs = {k.arg: None for k in node.keywords if k.arg}
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            errors.append((node.lineno, f"line {node.lineno}: {name}: {e}"))
    return [error for _, error in sorted(errors)]


def test_every_python_block_calls_the_api_as_it_is() -> None:
    for key, way in BLOCKS.items():
        if way.how == "python":
            block = _block(key)
            assert api_call_errors(block.text) == [], f"README.md line {block.line} ({key})"


# -- the checks themselves fail when a block is broken -----------------------------------------------
SYNTHETIC = """# Title

```bash
dapple plan --profile paper:bert48 --cluster paper-a
```

## Usage

text
~~~
# not a heading
sample output
~~~

```python
print("hi")
```

- a list item:

  ```bash title="indented"
  dapple simulate --help
  ```
"""


def test_extract_blocks_finds_sections_languages_and_lines() -> None:
    blocks = extract_blocks(SYNTHETIC)
    assert [(b.key, b.lang, b.line) for b in blocks] == [
        ("Title#0", "bash", 3), ("Usage#0", "", 10), ("Usage#1", "python", 15),
        ("Usage#2", "bash", 21),
    ]  # fmt: skip
    assert blocks[1].text == "# not a heading\nsample output\n"
    assert blocks[3].text == "dapple simulate --help\n"
    with pytest.raises(ValueError, match="line 3: fence ``` is never closed"):
        extract_blocks("x\n\n```bash\ndapple plan\n")


def test_a_new_or_changed_block_is_unaccounted() -> None:
    ways = {
        "Title#0": Way(how="shell", lang="bash", why="x"),
        "Usage#0": Way(how="output", lang="", why="x"),
        "Usage#1": Way(how="python", lang="python", why="x"),
        "Usage#2": Way(how="shell", lang="bash", why="x"),
    }
    assert unaccounted(extract_blocks(SYNTHETIC), ways) == []
    added = SYNTHETIC + "\n## New\n\n```bash\ndapple new-command\n```\n"
    assert unaccounted(extract_blocks(added), ways) == [
        "line 27: block 'New#0' (bash) is not in BLOCKS: run it there, or classify it with a reason"
    ]
    retyped = SYNTHETIC.replace("```python", "```")
    assert unaccounted(extract_blocks(retyped), ways) == [
        "line 15: block 'Usage#1' is ```, BLOCKS expects ```python"
    ]
    removed = SYNTHETIC.split("## Usage")[0]
    assert len(unaccounted(extract_blocks(removed), ways)) == 3


def test_a_substitution_that_no_longer_matches_fails() -> None:
    assert shrink("train --steps 1000\n", (("--steps 1000", "--steps 2"),)) == "train --steps 2\n"
    with pytest.raises(AssertionError, match="matches 0 times"):
        shrink("train --steps 500\n", (("--steps 1000", "--steps 2"),))
    with pytest.raises(AssertionError, match="matches 2 times"):
        shrink("a --steps 1000\nb --steps 1000\n", (("--steps 1000", "--steps 2"),))


def test_a_broken_command_fails_the_parse_check() -> None:
    from dapple.cli import build_parser

    parser = build_parser()
    block = (
        'M="-m transformer --set layers=2"\n'
        "dapple data prepare a.txt -o d/train.bin && dapple profile $M --batch-sizes 1 -o p.json\n"
        "dapple plan --profile p.json --cluster paper-a --schedule zbh1 \\\n  --global-batch-size 8"
        "  # a comment\n"
        "dapple simulate --plan p.json --profile p.json --cluster paper-a --no-such-flag\n"
        "dapple plan --schedule no-such-schedule\n"
        "dapple no-such-command\n"
    )
    commands = dapple_commands(block)
    assert commands[1] == ["profile", "-m", "transformer", "--set", "layers=2", "--batch-sizes",
                           "1", "-o", "p.json"]  # fmt: skip
    errors = [parse_error(argv, parser) for argv in commands]
    assert errors[:3] == [None, None, None]
    assert errors[3] and "--no-such-flag" in errors[3]
    assert errors[4] and "no-such-schedule" in errors[4]
    assert errors[5] and "no-such-command" in errors[5]


def test_a_failing_command_fails_its_block(tmp_path: Path) -> None:
    """A command failing mid-block fails it even when later ones succeed; a missing expected
    line or file fails it too."""
    block = Block("Demo", 0, "bash", 1, "dapple plan --profile paper:bert48 --cluster no-such\n"
                                        "echo done\n")  # fmt: skip
    way = Way(how="shell", lang="bash", why="x", timeout_s=120)
    with pytest.raises(AssertionError, match=r"exit 2:[\s\S]*no-such"):
        run_block(block, way, tmp_path)
    ok = Block("Demo", 0, "bash", 1, "dapple --help > help.txt\necho done\n")
    assert "done" in run_block(ok, way, tmp_path)
    with pytest.raises(AssertionError, match="'step 9' not in its output"):
        run_block(ok, Way(how="shell", lang="bash", why="x", expect=("step 9",)), tmp_path)
    with pytest.raises(AssertionError, match=r"it left no plan\.json"):
        run_block(ok, Way(how="shell", lang="bash", why="x", files=("plan.json",)), tmp_path)


def test_a_wrong_api_call_fails_the_python_check() -> None:
    source = (
        "import dapple.api as dp\n"
        'wl = dp.load("mlp", layers=2)\n'
        'plan = dp.plan(prof, "local-cpu", global_batch_size=8)\n'
        'dp.plan(prof, "local-cpu", global_batch=8)\n'
        "dp.no_such_function(wl)\n"
    )
    errors = api_call_errors(source)
    assert len(errors) == 2, errors
    assert errors[0].startswith("line 4: dp.plan: ") and "global_batch" in errors[0]
    assert errors[1] == "line 5: dp.no_such_function does not exist"
