"""The README's commands: the quick start makes its own environment, every `moetrain` line parses, and the
paths it names are where moetrain writes."""

import re
import shlex
from pathlib import Path

from moetrain import cli
from moetrain.config.load import load_config

README = Path(__file__).resolve().parents[2] / "README.md"


def bash_blocks() -> list[list[str]]:
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [block.replace("\\\n", " ").splitlines() for block in blocks]


def test_the_first_two_commands_install_into_a_venv_then_train_and_test():
    first, second = bash_blocks()[:2]
    assert first[0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==")
    assert first[0].endswith("&& moetrain train")
    assert second == ['pip install -e ".[test]" && python -m pytest -q']


def test_every_moetrain_command_in_the_readme_parses():
    parser = cli.build_parser()
    lines = [line for block in bash_blocks() for line in block if line.strip().startswith("moetrain ")]
    assert len(lines) > 10
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        cli._parse(parser, argv)  # argparse exits on a command the CLI does not have


def test_the_export_example_reads_where_the_default_run_writes():
    text = README.read_text()
    (ckpt,) = re.findall(r"moetrain convert moetrain-to-hf --ckpt (\S+)", text)
    assert ckpt == load_config().train.out_dir
