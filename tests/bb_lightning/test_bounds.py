"""Every value the command line and the recipes take, out of its range: one stderr line
naming the key, the value and what is accepted, exit code 2, before any work.

Each case runs ``bb_lightning.cli.main`` in-process, as a user's command line would; all
of them fail while the recipe is parsed or its classes are built (no model runs). The
same checks raise ``ValueError`` for Python users (the last tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bb_lightning.bounds import check_int, check_number
from bb_lightning.cli import UsageError, main, parse_recipe
from bb_lightning.data import PromptsDataModule, TextDataModule
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import PlanOverrides
from bb_lightning.strategy.core import BalanceBeamStrategy
from storage.tiers import Tier

_HELP = "(see bb-lightning {} --help)"

MODEL = "model.init_args."
DATA = "data.init_args."
STRATEGY = "trainer.strategy.init_args."

LIGHTNING_CASES: list[tuple[str, str, list[str]]] = [
    # (data module, "key=value" after --, words of the one line)
    ("prompts", f"{MODEL}max_new_tokens=-3", [f"{MODEL}max_new_tokens=-3:", "integer >= 1", "e.g. 64"]),
    ("prompts", f"{MODEL}max_new_tokens=0", [f"{MODEL}max_new_tokens=0:", "integer >= 1"]),
    ("prompts", f"{MODEL}max_new_tokens=abc", [f"{MODEL}max_new_tokens='abc'", "expected an integer"]),
    ("prompts", f"{MODEL}temperature=-0.5", [f"{MODEL}temperature=-0.5:", "number >= 0"]),
    ("prompts", f"{MODEL}top_k=-1", [f"{MODEL}top_k=-1:", "integer >= 0"]),
    ("prompts", f"{MODEL}top_p=0", [f"{MODEL}top_p=0", "number in (0, 1]"]),
    ("prompts", f"{MODEL}top_p=1.5", [f"{MODEL}top_p=1.5:", "number in (0, 1]"]),
    ("text", f"{MODEL}warmup_steps=-2", [f"{MODEL}warmup_steps=-2:", "integer >= 0"]),
    ("text", f"{MODEL}learning_rate=-0.1", [f"{MODEL}learning_rate=-0.1:", "number >= 0"]),
    ("text", f"{MODEL}eps=0", [f"{MODEL}eps=0", "number > 0"]),
    ("text", f"{MODEL}weight_decay=-1", [f"{MODEL}weight_decay=-1", "number >= 0"]),
    ("text", f"{MODEL}betas=[0.9,1.5]", [f"{MODEL}betas[1]=1.5:", "number in [0, 1)"]),
    ("text", f"{MODEL}seed=-1", [f"{MODEL}seed=-1:", "integer in 0.."]),
    ("text", f"{DATA}seq_len=0", [f"{DATA}seq_len=0:", "integer >= 1", "tokens per row"]),
    ("text", f"{DATA}batch_size=-4", [f"{DATA}batch_size=-4:", "integer >= 1"]),
    ("text", f"{DATA}val_fraction=1.0", [f"{DATA}val_fraction=1.0:", "number in [0, 1)"]),
    ("text", f"{DATA}max_files=0", [f"{DATA}max_files=0:", "integer >= 1", "or null"]),
    ("text", f"{DATA}max_tokens=3", [f"{DATA}max_tokens=3:", "integer >= 512"]),
    ("text", f"{DATA}num_workers=-1", [f"{DATA}num_workers=-1:", "integer in 0.."]),
    ("prompts", f"{DATA}batch_size=0", [f"{DATA}batch_size=0:", "integer >= 1", "or null"]),
    ("prompts", f"{DATA}max_prompt_len=0", [f"{DATA}max_prompt_len=0:", "integer >= 1"]),
    ("prompts", f"{DATA}num_workers=-2", [f"{DATA}num_workers=-2:", "integer in 0.."]),
    ("prompts", f"{DATA}num_workers=100000", [f"{DATA}num_workers=100000:", "integer in 0.."]),
    ("text", f"{STRATEGY}warmup_steps=0", [f"{STRATEGY}warmup_steps=0:", ">= 1"]),
    ("text", f"{STRATEGY}adapt_tolerance=-1", [f"{STRATEGY}adapt_tolerance=-1", ">= 0"]),
    ("text", f"{STRATEGY}gather_limit=-5", [f"{STRATEGY}gather_limit=-5:", "integer >= 0"]),
    ("text", f"{STRATEGY}hardware=t5", [f"{STRATEGY}hardware='t5':", "'measure'", "t4"]),
    ("text", f"{STRATEGY}compute_dtype=bf17", [f"{STRATEGY}compute_dtype='bf17'", "bf16, fp32"]),
    ("text", f"{STRATEGY}overrides.prefetch_depth=0", [f"{STRATEGY}overrides.prefetch_depth=0:", "integer >= 1"]),
    ("text", f"{STRATEGY}overrides.micro_batch=-1", [f"{STRATEGY}overrides.micro_batch=-1:", "integer >= 1"]),
    ("text", f"{STRATEGY}overrides.resident_blocks=-1", [f"{STRATEGY}overrides.resident_blocks=-1:", "integer >= 0"]),
    ("text", f"{STRATEGY}overrides.weights_tier=gpu", [f"{STRATEGY}overrides.weights_tier='gpu'", "DEVICE, HOST, NVME"]),
    ("text", f"{STRATEGY}store.device_budget=-1 --{STRATEGY}store.host_budget=1", [f"{STRATEGY}store.device_budget=-1:", ">= 0 (bytes)"]),
    ("text", f"{STRATEGY}store.device_budget=12GiB", [f"{STRATEGY}store.device_budget='12GiB'", "expected an integer"]),
    ("text", "sample_tokens=0", ["sample_tokens=0:", "integer >= 1"]),
    ("text", "seed_everything=-5", ["seed_everything=-5:", "integer in 0..4294967295"]),
    ("text", "trainer.max_steps=abc", ["trainer.max_steps='abc' is not valid: expected an integer"]),
    ("text", "trainer.max_steps=-5", ["`max_steps` must be a non-negative integer or -1", "-5"]),
    ("text", f'{MODEL}lora={{"rank": 0}}', ["model: LoRA rank=0 must be a positive integer"]),
    ("text", f'{MODEL}lora={{"alpha": "x"}}', ["LoRA alpha='x' must be a number > 0"]),
    ("text", f'{MODEL}lora={{"target_modules": 5}}', ["LoRA target_modules=5 must be a list"]),
]  # fmt: skip

PLAN_CASES: list[tuple[list[str], list[str]]] = [
    (["plan", "--seq-len", "0"], ["--seq-len", "'0'", "integer >= 1"]),
    (["plan", "--task", "predict", "--new-tokens", "-3"], ["--new-tokens", "'-3'", "integer >= 1"]),
    (["plan", "--task", "predict", "--prompt-len", "0"], ["--prompt-len", "'0'", "integer >= 1"]),
    (["plan", "--task", "predict", "--num-prompts", "x"], ["--num-prompts", "'x'", "integer >= 1"]),
    (["plan", "--devices", "0"], ["--devices", "'0'", "integer >= 1"]),
    (["plan", "--global-batch", "0"], ["--global-batch '0'", "tokens", "512s"]),
    (["plan", "--hardware", "t4", "--device-memory", "0GiB"], ["--device-memory '0GiB'", "at least 1 byte"]),
    (["plan", "--hardware", "t4", "--host-memory", "lots"], ["bad size 'lots' for --host-memory", "24GiB"]),
    (["plan", "--hardware", "t4", "--nvme-capacity", "0"], ["--nvme-capacity '0'", "at least 1 byte"]),
    (["plan", "--hardware", "t5"], ["'t5'", "t4"]),
    (["plan", "--task", "fitt"], ["--task", "'fitt'", "did you mean 'fit'?"]),
    (["convert", ".", "out", "--capacity", "0"], ["--capacity '0'", "at least 1 byte"]),
    (["convert", ".", "out", "--io-backend", "posx"], ["'posx'", "did you mean 'posix'?"]),
    (["export", ".", "out", "--max-shard-size", "0MB"], ["--max-shard-size '0MB'", "at least 1 byte"]),
]  # fmt: skip


def _data(kind: str, root: Path) -> list[str]:
    if kind == "text":
        return [
            "--data.class_path=bb_lightning.data.TextDataModule",
            f"--data.init_args.paths={root / 'absent.txt'}",
        ]
    return [
        "--data.class_path=bb_lightning.data.PromptsDataModule",
        f"--data.init_args.path={root / 'absent.jsonl'}",
    ]


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: a refused command must leave it empty."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize(
    ("data", "setting", "words"), LIGHTNING_CASES, ids=[c[1] for c in LIGHTNING_CASES]
)
def test_recipe_value_out_of_range(
    data: str, setting: str, words: list[str], empty: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = "predict" if data == "prompts" else "fit"
    argv = [
        command,
        "--model.class_path=bb_lightning.module.CausalLMModule",
        *_data(data, empty),
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.strategy.init_args.hardware=t4",
        *[f"--{s}" for s in setting.split(" --")],
    ]
    line = _one_line(argv, capsys)
    for word in [*words, _HELP.format(command)]:
        assert word in line, (word, line)
    assert os.listdir(empty) == [], os.listdir(empty)


PARSE_ONLY = [
    c for c in LIGHTNING_CASES if not any(w in c[1] for w in ("lora", "store.", "max_steps=-"))
]
"""The cases :func:`parse_recipe` refuses too (it builds nothing: these checks need no
model config, tokenizer or machine)."""


@pytest.mark.parametrize(("data", "setting", "words"), PARSE_ONLY, ids=[c[1] for c in PARSE_ONLY])
def test_parse_recipe_refuses_the_same_values(
    data: str, setting: str, words: list[str], empty: Path
) -> None:
    command = "predict" if data == "prompts" else "fit"
    argv = [command, "--model.class_path=bb_lightning.module.CausalLMModule", *_data(data, empty),
            *[f"--{s}" for s in setting.split(" --")]]  # fmt: skip
    with pytest.raises(UsageError) as err:
        parse_recipe(argv)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert os.listdir(empty) == [], os.listdir(empty)


def test_a_bad_value_stops_the_run_before_its_nvme_directory_is_made(
    empty: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--model.class_path=bb_lightning.module.CausalLMModule",
            *_data("prompts", empty), f"--{STRATEGY}nvme_path={empty / 'runs' / 'nvme'}",
            f"--{MODEL}max_new_tokens=0"]  # fmt: skip
    assert f"{MODEL}max_new_tokens=0:" in _one_line(argv, capsys)
    assert os.listdir(empty) == [], os.listdir(empty)


@pytest.mark.parametrize(("argv", "words"), PLAN_CASES, ids=[" ".join(c[0]) for c in PLAN_CASES])
def test_subcommand_flag_out_of_range(
    argv: list[str], words: list[str], empty: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line(argv, capsys)
    for word in words:
        assert word in line, (word, line)
    assert os.listdir(empty) == [], os.listdir(empty)


def test_python_constructors_refuse_the_same_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_new_tokens=-3: must be an integer >= 1"):
        CausalLMModule(max_new_tokens=-3)
    with pytest.raises(ValueError, match=r"^top_p=nan: must be a number in \(0, 1\]"):
        CausalLMModule(top_p=float("nan"))
    with pytest.raises(ValueError, match=r"^max_new_tokens=True: must be an integer"):
        CausalLMModule(max_new_tokens=True)
    with pytest.raises(ValueError, match=r"^stop_strings=\[''\]: each must be a non-empty"):
        CausalLMModule(stop_strings=[""], tokenizer="byte")
    with pytest.raises(ValueError, match=r"^seq_len=0: must be an integer >= 1"):
        TextDataModule("x.txt", seq_len=0)
    with pytest.raises(ValueError, match=r"^num_workers=-1: must be an integer in 0\.\.\d+"):
        PromptsDataModule("x.jsonl", num_workers=-1)
    with pytest.raises(ValueError, match=r"^hardware='h1000': .* \(closest: 'h100'\)"):
        BalanceBeamStrategy(hardware="h1000")
    with pytest.raises(ValueError, match=r"^PlanOverrides\.grad_accum=0: must be an integer >= 1"):
        PlanOverrides(grad_accum=0)
    with pytest.raises(ValueError, match=r"^PlanOverrides\.master_tier='disk': must be a tier"):
        PlanOverrides(master_tier="disk")  # type: ignore[arg-type]
    assert PlanOverrides(weights_tier="NVME").weights_tier is Tier.NVME  # type: ignore[arg-type]
    assert BalanceBeamStrategy(hardware="T4").hardware == "T4"  # presets are case-insensitive


@pytest.mark.parametrize(
    ("value", "ok"),
    [(1, True), (0, False), (True, False), (2.0, False), (None, False), ("3", False)],
)
def test_check_int(value: object, ok: bool) -> None:
    if ok:
        check_int("n", value, low=1, what="things", example=4)
    else:
        with pytest.raises(ValueError, match=r"^n=.*: must be an integer >= 1 \(things\), e.g. 4$"):
            check_int("n", value, low=1, what="things", example=4)
    check_int("n", None, low=1, what="things", example=4, none="all")  # None allowed


@pytest.mark.parametrize(
    ("value", "ok"),
    [(0.5, True), (1, True), (0.0, False), (1.0000001, False), (float("inf"), False),
     (float("nan"), False), (False, False), ("0.5", False)],
)  # fmt: skip
def test_check_number(value: object, ok: bool) -> None:
    kwargs = {"low": 0.0, "high": 1.0, "low_open": True, "what": "share", "example": 0.9}
    if ok:
        check_number("p", value, **kwargs)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=r"^p=.*: must be a number in \(0, 1\] \(share\)"):
            check_number("p", value, **kwargs)  # type: ignore[arg-type]
