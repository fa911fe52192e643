"""The command-line reference, docs/reference.md's generated block, from the argparse tree that `rpcfleet`
itself parses (`orchestrator.cli.build_parser`): every command, its description and its options.

    python scripts/cli_reference.py           # print the block
    python scripts/cli_reference.py --write   # replace the block in docs/reference.md

The block is Markdown of its own (no `--help` text), so it reads the same whatever the terminal's width
or Python's argparse version. tests/project/test_docs.py checks that the committed page is what this
prints.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"
BEGIN = "<!-- scripts/cli_reference.py: generated, do not edit -->"
END = "<!-- end scripts/cli_reference.py -->"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # aliases map to the same parser
                    seen.add(id(sub))
                    found.append((name, sub))
    return found


def _option_name(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return formatter._format_args(action, action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = formatter._format_args(action, action.dest.upper())
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(
            action, argparse._SubParsersAction | argparse._HelpAction
        ):
            continue
        help_text = _one_line(formatter._expand_help(action) if action.help else "")
        rows.append(f"| `{_cell(_option_name(action, formatter))}` | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| option | meaning |", "|---|---|", *rows, ""]


def _command(path: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{path}`", ""]
    description = _one_line(parser.description)
    if description:
        lines += [description, ""]
    lines += _options(parser)
    children = _subparsers(parser)
    if children:
        lines += ["Commands: " + ", ".join(f"`{name}`" for name, _ in children) + ".", ""]
    for name, child in children:
        lines += _command(f"{path} {name}", child, min(level + 1, 4))
    return lines


def _declared_options() -> list[str]:
    """The planning and probe options' one declaration, with the playbook steps' arguments made from it."""
    from orchestrator.playbooks.ops import REGISTRY
    from orchestrator.workflows.options import PLAN_OPTIONS, PROBE_OPTIONS

    steps: dict[str, list[str]] = {}
    for op in REGISTRY.values():
        for arg in op.args:
            if arg.option is not None:
                steps.setdefault(arg.option.name, []).append(op.name)
    lines = [
        "## Planning and probe options",
        "",
        "Declared once (`orchestrator/workflows/options.py`): the flags above and the playbook steps' "
        "arguments are made from it, with the same names, defaults and values.",
        "",
        "| flags | playbook argument (steps) | default | meaning |",
        "|---|---|---|---|",
    ]
    for option in (*PLAN_OPTIONS, *PROBE_OPTIONS):
        used = steps.get(option.name)
        argument = f"`{option.name}` ({', '.join(used)})" if used else "-"
        default = "unset" if option.default is None else f"`{option.default}`"
        flags = _cell(", ".join(option.flags))
        lines.append(f"| `{flags}` | {argument} | {default} | {_cell(_one_line(option.help))} |")
    return [*lines, ""]


def _serve_options() -> list[str]:
    """serve's own options' one declaration (the planning ones are above)."""
    from orchestrator.workflows.serve_options import OWN_OPTIONS

    lines = [
        "## Serve options",
        "",
        "Declared once (`orchestrator/workflows/serve_options.py`): `rpcfleet serve`'s flags (and `plan`'s "
        "and `report`'s --replicas) are made from it; its defaults are the serving limits' "
        "(`orchestrator/serve/settings.py`).",
        "",
        "| flags | default | meaning |",
        "|---|---|---|",
    ]
    for option in OWN_OPTIONS:
        default = "unset" if option.default is None else f"`{option.default}`"
        flags = _cell(", ".join(option.flags))
        lines.append(f"| `{flags}` | {default} | {_cell(_one_line(option.help))} |")
    return [*lines, ""]


def generate() -> str:
    """The block's text, markers excluded."""
    from orchestrator.cli import build_parser

    parser = build_parser()
    lines = [f"`rpcfleet --help`: {_one_line(parser.description)} {_one_line(parser.epilog)}", ""]
    top = _subparsers(parser)
    lines += ["Commands: " + ", ".join(f"[`{name}`](#rpcfleet-{name})" for name, _ in top) + ".", ""]
    for name, sub in top:
        lines += _command(f"rpcfleet {name}", sub, 2)
    lines += _declared_options()
    lines += _serve_options()
    return "\n".join(lines).rstrip("\n") + "\n"


def replace_block(page: str, block: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError(f"{PAGE} has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{block}{END}", page, count=1)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    block = generate()
    if argv == ["--write"]:
        PAGE.write_text(replace_block(PAGE.read_text(), block))
        return 0
    if argv:
        sys.stderr.write(__doc__ or "")
        return 2
    sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
