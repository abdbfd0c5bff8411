"""`q4k quantize`: F32 (or quantized) GGUF in, a loadable llama.cpp-style Q4_K_M file out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

import actors.cli
import actors.model.gguf.quantize_file as quantize_file_module
from actors.errors import InvalidRequest, ModelFormatError
from actors.model.gguf.quantize_file import FILE_TYPES, plan_tensor_types, quantize_file, use_more_bits
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import TensorInfo, open_gguf
from tests.conftest import TINY_MODELS, gemma3_path


def _write_float_copy(source: Path, destination: Path, type_name: str = "F32") -> None:
    """The model with every tensor dequantized to F32 (or F16/BF16): what llama.cpp's
    quantizer starts from."""
    reader = GGUFReader(source)
    gguf_file = open_gguf(source)
    writer = GGUFWriter(destination, gguf_file.require("general.architecture"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(0)
    for info in gguf_file.tensors.values():
        values = dequantize(gguf_file.raw(info.name), info.type_name, info.shape)
        if type_name == "F16":
            writer.add_tensor(info.name, values.astype(np.float16))
        elif type_name == "BF16":
            bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine here
            writer.add_tensor(info.name, bits.view(np.uint8), raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(info.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_file.close()


@pytest.fixture(scope="session")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("f32_models")
    paths = {}
    for name, path in TINY_MODELS.items():
        paths[name] = folder / f"{name}-f32.gguf"
        _write_float_copy(path, paths[name])
    return paths


@pytest.fixture(scope="session")
def q4_k_m_models(
    f32_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("q4_k_m_models")
    out = {}
    for name, path in f32_models.items():
        out[name] = folder / f"{name}-Q4_K_M.gguf"
        quantize_file(path, out[name], "Q4_K_M")
    return out


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_q4_k_m_gives_llama_cpps_types(model: str, q4_k_m_models: dict[str, Path]) -> None:
    # The tiny models were made from F32 by llama.cpp's own Q4_K_M: same type per tensor.
    ours = open_gguf(q4_k_m_models[model])
    theirs = open_gguf(TINY_MODELS[model])
    assert {n: t.type_name for n, t in ours.tensors.items()} == {
        n: t.type_name for n, t in theirs.tensors.items()
    }
    assert [t.shape for t in ours.tensors.values()] == [t.shape for t in theirs.tensors.values()]


def test_recipe_matches_the_default_models_types() -> None:
    gemma = open_gguf(gemma3_path())  # llama.cpp Q4_K_M: Q5_0/Q8_0 fallbacks for 640-wide rows
    plan = plan_tensor_types(list(gemma.tensors.values()), "Q4_K_M")
    assert plan == {name: info.type_name for name, info in gemma.tensors.items()}


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_output_loads_in_both_readers_with_metadata_kept(
    model: str, f32_models: dict[str, Path], q4_k_m_models: dict[str, Path]
) -> None:
    source, output = GGUFReader(f32_models[model]), GGUFReader(q4_k_m_models[model])
    assert len(output.tensors) == len(source.tensors)
    assert set(output.fields) == set(source.fields) | {"general.quantization_version"}
    assert output.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    arch = source.fields["general.architecture"].contents()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", f"{arch}.block_count"):
        assert output.fields[key].contents() == source.fields[key].contents()
        assert output.fields[key].types == source.fields[key].types


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_quantized_tensors_stay_close_to_the_originals(
    model: str, f32_models: dict[str, Path], q4_k_m_models: dict[str, Path]
) -> None:
    source, output = open_gguf(f32_models[model]), open_gguf(q4_k_m_models[model])
    for info in output.tensors.values():
        original = source.raw(info.name).view(np.float32).reshape(info.shape)
        restored = dequantize(output.raw(info.name), info.type_name, info.shape)
        if info.type_name == "F32":
            assert np.array_equal(restored, original), info.name
            continue
        # The originals were Q4_K/Q6_K values already: requantizing them loses little.
        relative = np.sqrt(np.mean((restored - original) ** 2) / np.mean(original**2))
        assert relative < (0.05 if info.type_name == "Q4_K" else 0.02), info.name


@pytest.mark.parametrize(
    ("recipe", "file_type", "expected_types"),
    [
        ("Q8_0", 7, {"F32", "Q8_0"}),
        ("Q6_K", 18, {"F32", "Q6_K"}),
        ("Q4_K_S", 14, {"F32", "Q4_K", "Q5_K", "Q6_K"}),
    ],
)
def test_other_recipes(
    recipe: str,
    file_type: int,
    expected_types: set[str],
    f32_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    output = tmp_path / f"{recipe}.gguf"
    mix = quantize_file(f32_models["llama-q4k-tiny"], output, recipe)
    gguf_file = open_gguf(output)
    assert set(mix) == expected_types == {t.type_name for t in gguf_file.tensors.values()}
    assert GGUFReader(output).fields["general.file_type"].contents() == file_type
    for info in gguf_file.tensors.values():  # every tensor decodes
        assert np.isfinite(dequantize(gguf_file.raw(info.name), info.type_name, info.shape)).all()


@pytest.mark.parametrize("source_type", ["F16", "BF16"])
def test_half_precision_sources(source_type: str, tmp_path: Path) -> None:
    source = tmp_path / f"{source_type}.gguf"
    _write_float_copy(TINY_MODELS["qwen2-q4k-tiny"], source, source_type)
    output = tmp_path / "out.gguf"
    quantize_file(source, output, "Q4_K_M")
    original, quantized = open_gguf(source), open_gguf(output)
    expected = plan_tensor_types(list(original.tensors.values()), "Q4_K_M")
    assert {n: t.type_name for n, t in quantized.tensors.items()} == expected
    assert {t.type_name for t in quantized.tensors.values() if len(t.shape) == 1} == {source_type}
    for info in quantized.tensors.values():
        source_info = original.tensors[info.name]
        before = dequantize(original.raw(info.name), source_info.type_name, info.shape)
        after = dequantize(quantized.raw(info.name), info.type_name, info.shape)
        relative = np.sqrt(np.mean((after - before) ** 2) / np.mean(before**2))
        assert relative < 0.05, info.name


def test_requantizing_copies_unchanged_tensors_and_converts_the_rest(tmp_path: Path) -> None:
    source_path = TINY_MODELS["qwen2-q4k-tiny"]
    same = tmp_path / "same.gguf"
    quantize_file(source_path, same, "Q4_K_M")  # already Q4_K_M: every tensor copied
    source, copy = open_gguf(source_path), open_gguf(same)
    for info in source.tensors.values():
        assert np.array_equal(copy.raw(info.name), source.raw(info.name)), info.name

    q8 = tmp_path / "q8.gguf"
    quantize_file(source_path, q8, "Q8_0")
    converted = open_gguf(q8)
    weight = source.tensors["blk.0.attn_q.weight"]
    original = dequantize(source.raw(weight.name), weight.type_name, weight.shape)
    restored = dequantize(converted.raw(weight.name), "Q8_0", weight.shape)
    assert np.sqrt(np.mean((restored - original) ** 2) / np.mean(original**2)) < 0.01


def _info(name: str, shape: tuple[int, ...], type_name: str = "F32") -> TensorInfo:
    return TensorInfo(name=name, type_name=type_name, ggml_type=0, shape=shape, offset=0, n_bytes=0)


def test_recipe_fallbacks_for_rows_not_a_multiple_of_256() -> None:
    tensors = [
        _info("token_embd.weight", (1000, 640)),  # tied output, 640-wide: Q8_0
        _info("blk.0.attn_q.weight", (640, 640)),  # Q4_K -> Q5_0
        _info("blk.0.attn_v.weight", (128, 640)),  # use_more_bits: Q6_K -> Q8_0
        _info("blk.0.ffn_down.weight", (640, 100)),  # not even whole 32-blocks: F16
        _info("blk.0.attn_norm.weight", (640,)),
        _info("blk.0.ffn_gate.weight", (512, 256), "BF16"),
        _info("rope_freqs.weight", (64,), "F16"),  # 1-D keeps its float type
    ]
    assert plan_tensor_types(tensors, "Q4_K_M") == {
        "token_embd.weight": "Q8_0",
        "blk.0.attn_q.weight": "Q5_0",
        "blk.0.attn_v.weight": "Q8_0",
        "blk.0.ffn_down.weight": "F16",
        "blk.0.attn_norm.weight": "F32",
        "blk.0.ffn_gate.weight": "Q4_K",
        "rope_freqs.weight": "F16",
    }
    assert plan_tensor_types(tensors, "Q4_K_S")["blk.0.attn_v.weight"] == "Q5_1"  # Q5_K -> Q5_1


def test_use_more_bits_layers() -> None:
    assert [i for i in range(18) if use_more_bits(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    assert [i for i in range(3) if use_more_bits(i, 3)] == [2]


def test_unknown_recipe_names_it() -> None:
    with pytest.raises(InvalidRequest, match="Q3_K") as caught:
        plan_tensor_types([], "Q3_K")
    assert caught.value.field == "type"


def test_refuses_to_overwrite_its_input(f32_models: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="differ"):
        quantize_file(f32_models["llama-q4k-tiny"], f32_models["llama-q4k-tiny"], "Q8_0")


def test_a_failure_leaves_no_file(
    f32_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(values: np.ndarray, target: str) -> np.ndarray:
        raise ModelFormatError("broken on purpose")

    monkeypatch.setattr(quantize_file_module, "_encode", broken)
    with pytest.raises(ModelFormatError, match="on purpose"):
        quantize_file(f32_models["llama-q4k-tiny"], tmp_path / "out.gguf", "Q4_K_M")
    assert list(tmp_path.iterdir()) == []


def test_non_finite_weights_name_the_tensor(tmp_path: Path) -> None:
    source = tmp_path / "nan.gguf"
    writer = GGUFWriter(source, "llama")
    weights = np.ones((4, 256), np.float32)
    weights[2, 3] = np.nan
    writer.add_tensor("blk.0.ffn_up.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="'blk.0.ffn_up.weight': cannot quantize NaN"):
        quantize_file(source, tmp_path / "out.gguf", "Q4_K_M")
    assert not (tmp_path / "out.gguf").exists()


def test_unwritable_output_is_named(f32_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot write") as caught:
        quantize_file(f32_models["llama-q4k-tiny"], tmp_path / "missing" / "out.gguf", "Q8_0")
    assert caught.value.field == "output"


def test_progress_bar_on_request(f32_models: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "out.gguf"
    quantize_file(f32_models["llama-q4k-tiny"], output, "Q8_0", show_progress=True)
    assert open_gguf(output).tensors


# ---------------------------------------------------------------------------------------------
# The command


@pytest.fixture
def q4k(monkeypatch: pytest.MonkeyPatch):
    """`q4k` with only this verb registered, so other verbs' imports don't matter here."""
    monkeypatch.setattr(actors.cli, "VERB_MODULES", ("quantize",))
    return actors.cli.main


def test_cli_writes_the_file_and_a_summary(
    q4k, f32_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out.gguf"
    source = str(f32_models["qwen2-q4k-tiny"])
    assert q4k(["quantize", source, str(output), "--type", "q4_k_m"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Q4_K_M" in err and "Q6_K" in err  # no bar off a terminal
    assert GGUFReader(output).fields["general.file_type"].contents() == 15


def test_the_examples_in_help_run_as_shown(
    q4k, f32_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each example command line of `q4k quantize --help`, whole on its line, writes its
    OUTPUT (from a float model standing in for its INPUT)."""
    with pytest.raises(SystemExit):
        q4k(["quantize", "--help"])
    examples = [line.split() for line in capsys.readouterr().out.splitlines()
                if line.startswith("  q4k quantize ")]
    assert len(examples) >= 2
    source = str(f32_models["qwen2-q4k-tiny"])
    for _q4k, verb, _input, output, *flags in examples:
        assert q4k([verb, source, str(tmp_path / output), *flags]) == 0, (output, flags)
        type_name = flags[flags.index("--type") + 1] if "--type" in flags else "Q4_K_M"
        written = GGUFReader(tmp_path / output).fields["general.file_type"].contents()
        assert written == FILE_TYPES[type_name].value


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/model.gguf", "OUT"], "no such model file"),
        (["MODEL", "OUT", "--type", "Q3_K"], "unknown quantization type 'Q3_K'"),
    ],
)
def test_cli_bad_input_is_one_line(
    q4k, args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"MODEL": str(TINY_MODELS["llama-q4k-tiny"]), "OUT": str(tmp_path / "o.gguf")}
    args = [names.get(arg, arg) for arg in args]
    assert q4k(["quantize", *args]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "o.gguf").exists()
