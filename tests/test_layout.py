"""FileMapper against fixed vectors: the same paths and config.json as vLLM's fs tier."""

from __future__ import annotations

import hashlib
import os

import pytest

from mptier import FileMapper, key_block_hash, key_group_idx, make_key, split_key

HASH = bytes(range(32))
HEX = HASH.hex()


@pytest.mark.parametrize("fields, base", [
    (dict(model_name="meta-llama/Llama-3.1-8B"), "meta-llama_Llama-3.1-8B_87842295ce6d"),
    (dict(model_name="m", tp_size=2, rank=1), "m_b0792da07750"),
    # parallel-agnostic collapses tp/pp/pcp/dcp to 1 and rank to 0
    (dict(model_name="m", tp_size=4, pp_size=2, rank=3, parallel_agnostic=True),
     "m_5ae00a0152b1"),
    (dict(model_name="org/m", dtype="float16", replicated_layout=True, canonical_format="x1",
          kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}]),
     "org_m_887e921440b9"),
])
def test_paths_match_fixed_vectors(fields, base):
    mapper = FileMapper("/kv", **fields)
    rank = 0 if fields.get("parallel_agnostic") else fields.get("rank", 0)
    assert mapper.config_path == f"/kv/{base}/config.json"
    assert mapper.path_for(make_key(HASH, 0)) == f"/kv/{base}_r{rank}/000/10_g0/{HEX}.bin"
    assert mapper.path_for(make_key(HASH, 7)) == f"/kv/{base}_r{rank}/000/10_g7/{HEX}.bin"


def test_base_hash_is_sha256_of_canonical_json():
    canonical = ('{"blocks_per_file":1,"dcp_size":1,"dtype":"bfloat16","inference_engine":'
                 '"vllm","kv_cache_groups":[],"model_name":"meta-llama/Llama-3.1-8B",'
                 '"parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":16,'
                 '"tp_size":1}')
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    mapper = FileMapper("/kv", model_name="meta-llama/Llama-3.1-8B")
    assert mapper.base_path == f"/kv/meta-llama_Llama-3.1-8B_{digest}"


def test_fields_only_carry_optional_entries_when_set():
    plain = FileMapper("/kv", "m").fields
    assert plain["parallel_agnostic"] is False
    assert "replicated_layout" not in plain and "canonical_format" not in plain
    agnostic = FileMapper("/kv", "m", parallel_agnostic=True).fields
    assert "parallel_agnostic" not in agnostic


def test_config_json_text_and_write_once(tmp_path):
    mapper = FileMapper(str(tmp_path), "org/m",
                        kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["l0"]}])
    mapper.write_config()
    expected = (
        '{\n  "blocks_per_file": 1,\n  "dcp_size": 1,\n  "dtype": "bfloat16",\n'
        '  "inference_engine": "vllm",\n  "kv_cache_groups": [\n    {\n'
        '      "layer_names": [\n        "l0"\n      ],\n      "tokens_per_block": 16\n'
        '    }\n  ],\n  "model_name": "org/m",\n  "parallel_agnostic": false,\n'
        '  "pcp_size": 1,\n  "pp_size": 1,\n  "tokens_per_hash": 16,\n  "tp_size": 1\n}')
    with open(mapper.config_path) as f:
        assert f.read() == expected
    with open(mapper.config_path, "w") as f:
        f.write("{}")
    mapper.write_config()  # written once: an existing file stays
    with open(mapper.config_path) as f:
        assert f.read() == "{}"
    assert os.path.isdir(mapper.blocks_dir)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(mapper.base_path), os.path.basename(mapper.blocks_dir)])


def test_unusable_root_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    mapper = FileMapper(str(blocker), "m")
    with pytest.raises(OSError, match="file"):
        mapper.write_config()


def test_key_helpers_round_trip():
    key = make_key(HASH, 5)
    assert key == HASH + b"\x00\x00\x00\x05"
    assert key_block_hash(key) == HASH and key_group_idx(key) == 5
    assert split_key(key) == (HASH, 5)
    with pytest.raises(ValueError):
        make_key(HASH, -1)
    with pytest.raises(TypeError):
        make_key("abc", 0)
