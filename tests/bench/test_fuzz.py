"""The fuzz harness's deterministic slice, and the inputs it found that once crashed.

Each surface of ``bench/fuzz_targets.py`` runs a few derandomized hypothesis examples: a
valid seed (a tiny model written by ``save_pretrained``, a store written by
``convert_checkpoint``, a checkpoint written by the checkpoint writer) mutated, then every
entry point on it must succeed or refuse in one line naming the input, within its time,
changing nothing it only reads. The long campaign is ``bench/fuzz.py``. The named tests
below are the crashes the campaign found, each checked against its entry point directly.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def fuzz() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        import fuzz_targets
        import fuzz_text

        fuzz_targets.SURFACES.update(fuzz_text.SURFACES)
        yield fuzz_targets
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


SLICE = {
    "config.json": 8,
    "safetensors": 8,
    "store": 8,
    "checkpoint": 5,
    "trainer-state": 5,
    "prompts": 10,
    "recipe": 6,
}
"""Examples per surface in the CI slice (a few seconds each surface on 2 cores)."""


@pytest.mark.parametrize("name", sorted(SLICE))
def test_surface_slice_never_crashes(name: str, fuzz: ModuleType, work: Path) -> None:
    surface = fuzz.SURFACES[name]

    @settings(
        max_examples=SLICE[name],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def case(data: st.DataObject) -> None:
        fuzz.run_case(surface, data, work / name)

    case()


def _cli(*argv: str) -> tuple[int, str]:
    from bb_lightning.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def _copy(seed: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(seed, to)
    return to


def _edit_json(path: Path, change: object) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    change(doc)  # type: ignore[operator]
    path.write_text(json.dumps(doc), encoding="utf-8")


def test_a_config_value_of_the_wrong_type_is_one_line_naming_config_json(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    model = _copy(fuzz.seed_model_dir(work / "seeds"), tmp_path / "m")
    _edit_json(model / "config.json", lambda d: d.update(intermediate_size=[[32]]))
    code, err = _cli("plan", "--model", str(model), "--hardware", "a100-80gb")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{model / 'config.json'} is not a usable model config" in err
    assert "intermediate_size" in err
    code, err = _cli("convert", str(model), str(tmp_path / "out"), "--no-progress")
    assert code == 2 and "config.json is not a usable model config" in err, err
    assert not (tmp_path / "out").exists()


def test_a_config_json_that_is_not_json_is_named(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    model = _copy(fuzz.seed_model_dir(work / "seeds"), tmp_path / "m")
    (model / "config.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    code, err = _cli("plan", "--model", str(model), "--hardware", "a100-80gb")
    assert code == 2 and f"{model / 'config.json'} is not UTF-8 JSON" in err


def test_an_array_whose_key_encoding_is_not_an_object_is_a_problem_line(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    store = _copy(fuzz.seed_store(work / "seeds"), tmp_path / "s")
    meta = store / "model.norm.weight" / "zarr.json"
    _edit_json(meta, lambda d: d.update(chunk_key_encoding=["default"]))
    code, out = _cli("verify", str(store))
    assert code == 1 and f"tensor 'model.norm.weight' (file {meta}): unreadable" in out


def test_array_metadata_with_a_bad_shape_is_refused_naming_the_file(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from storage.nvme import CorruptTensorError, UnsupportedArrayError, parse_array, row_chunks

    store = _copy(fuzz.seed_store(work / "seeds"), tmp_path / "s")
    meta = store / "model.norm.weight" / "zarr.json"
    good = json.loads(meta.read_text(encoding="utf-8"))
    for shape, chunks in (
        (["16"], [16]),  # a string
        ([16.5], [16]),  # a fraction
        ([-16], [16]),  # negative
        ([2**62], [2**62]),  # past any disk
        ([16], [0]),  # an empty chunk
        ([2**40], [1]),  # a trillion row chunks
    ):
        doc = json.loads(json.dumps(good))
        doc["shape"] = shape
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        meta.write_text(json.dumps(doc), encoding="utf-8")
        with pytest.raises(CorruptTensorError, match=str(meta).replace(".", r"\.")):
            row_chunks("model.norm.weight", meta)
    meta.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(CorruptTensorError, match="unreadable array metadata"):
        parse_array("model.norm.weight", meta)
    doc = json.loads(json.dumps(good))
    doc["codecs"] = {"bytes": {}}  # an object, not a list
    meta.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(UnsupportedArrayError, match=r"codecs \{'bytes': \{\}\} are not 'bytes'"):
        parse_array("model.norm.weight", meta)


def test_a_store_whose_group_json_is_damaged_is_refused_naming_it(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from storage.io import IOConfig, open_backend
    from storage.nvme import NvmeTier

    store = _copy(fuzz.seed_store(work / "seeds"), tmp_path / "s")
    for text in ("", "[1, 2]", "[" * 100_000):
        (store / "zarr.json").write_text(text, encoding="utf-8")
        backend = open_backend(IOConfig(backend="posix", threads=1))
        try:
            with pytest.raises(ValueError, match=str(store / "zarr.json").replace(".", r"\.")):
                NvmeTier(store, capacity=1 << 30, backend=backend)
        finally:
            backend.close()


def test_convert_resumed_over_a_damaged_chunk_writes_it_again(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from storage.verify import verify_group

    seeds = work / "seeds"
    store = _copy(fuzz.seed_store(seeds), tmp_path / "s")
    chunk = store / "lm_head.weight" / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF  # same length, wrong bytes
    chunk.write_bytes(bytes(raw))
    assert verify_group(store).problems
    code, err = _cli("convert", str(fuzz.seed_model_dir(seeds)), str(store), "--no-progress")
    assert code == 0, err
    assert verify_group(store).problems == []
    assert chunk.read_bytes() == (fuzz.seed_store(seeds) / chunk.relative_to(store)).read_bytes()


def test_a_damaged_trainer_state_is_one_problem_line(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from bb_lightning.engine.checkpoint import CheckpointError, read_trainer_state

    ckpt = _copy(fuzz.seed_checkpoint(work / "seeds"), tmp_path / "c")
    tensors = ckpt / "trainer_state.safetensors"
    raw = tensors.read_bytes()
    tensors.write_bytes(struct.pack("<Q", 2**63) + raw[8:])  # header length past the file
    with pytest.raises(CheckpointError, match=r"trainer_state\.safetensors: unreadable"):
        read_trainer_state(ckpt)
    code, out = _cli("verify", str(ckpt))
    assert code == 1 and "trainer_state.safetensors: unreadable" in out
    tensors.write_bytes(raw)
    state = ckpt / "trainer_state.json"
    for doc in ({"state": [1]}, {"state": {"a": {"__bb__": "tensor", "key": "t99"}}},
                {"state": {"a": {"__bb__": "dict", "items": [[{}, 1]]}}}):  # fmt: skip
        state.write_text(json.dumps(doc), encoding="utf-8")
        with pytest.raises(CheckpointError, match=r"trainer_state\.json: "):
            read_trainer_state(ckpt)


def test_a_damaged_meta_json_is_refused_before_any_path_is_built_from_it(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from bb_lightning.engine.checkpoint import CheckpointError, read_meta

    seed = fuzz.seed_checkpoint(work / "seeds")
    for i, change in enumerate(
        (
            lambda d: d["parameters"][0].update(name="../../../outside"),
            lambda d: d["parameters"][0].update(shape="16"),
            lambda d: d["parameters"][0].update(aliases=None),
            lambda d: d.update(parameters={"a": 1}),
            lambda d: d.update(step=-1),
            lambda d: d.update(weights_only="no"),
            lambda d: d.update(model=[]),
        )
    ):
        ckpt = _copy(seed, tmp_path / f"c{i}")
        _edit_json(ckpt / "meta.json", change)
        with pytest.raises(CheckpointError, match=r"meta\.json is damaged"):
            read_meta(ckpt)
        code, err = _cli("export", str(ckpt), str(tmp_path / f"out{i}"))
        assert code == 2 and "meta.json is damaged" in err


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"\xff\xfe model:", "cannot be read as UTF-8 text"),
        (b"", "holds a YAML NoneType, not a mapping"),
        (b"[1", "is not readable YAML"),
        (b"[" * 5000 + b"]" * 5000, "is not readable YAML (maximum recursion depth"),
        (b"[1, 2]", "holds a YAML list, not a mapping"),
        (b'model:\n  init_args:\n    "": 3\n', "has an empty key under 'model.init_args'"),
        (b"model: {class_path: bb_lightning.module.CausalLMModule}\n"
         b"data: {class_path: bb_lightning.data.PromptsDataModule, init_args: {path: p.jsonl}}\n"
         b"trainer: [1]\n", "recipe key 'trainer' is [1], not a mapping"),
    ],
)  # fmt: skip
def test_a_recipe_that_is_not_a_yaml_mapping_is_one_line_naming_it(
    text: bytes, says: str, tmp_path: Path
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text)
    code, err = _cli("predict", "--config", str(recipe))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert says in err and (str(recipe) in err or "'trainer'" in err), err


def test_a_converted_store_whose_group_json_nests_past_the_parser_is_named(
    fuzz: ModuleType, work: Path, tmp_path: Path
) -> None:
    from bb_lightning.hf.converted import converted_store

    store = _copy(fuzz.seed_store(work / "seeds"), tmp_path / "s")
    (store / "zarr.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match=f"store {store}: .*zarr.json is not readable JSON"):
        converted_store(store)
