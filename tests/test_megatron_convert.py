"""HF <-> Megatron-core weight conversion (tasks/sync/megatron_names.py): CPU only, no megatron-core needed."""

from __future__ import annotations

import pytest
import torch

from rollflow.tasks.sync import megatron_names as mn
from rollflow.tasks.sync.parity import checksums, compare


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=203,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).state_dict()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=150,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    sd = Qwen2ForCausalLM(config).state_dict()
    # Random init leaves biases at 0 and norms at 1: make every tensor distinct so a swap would show.
    sd = {k: v + torch.randn_like(v) * 0.01 for k, v in sd.items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied, as HF's state_dict lists it
    return config, sd


def _assert_bit_exact(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
    assert compare(checksums(a), checksums(b)).ok


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=150,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    sd = {k: v + torch.randn_like(v) * 0.01 for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    return config, sd


MODELS = {"llama": _llama, "llama_tied": lambda: _llama(tie=True), "qwen2": _qwen2, "qwen3": _qwen3}


def test_qwen3_q_k_norms_map_to_qk_layernorm():
    config, hf = _qwen3()
    layout = mn.MegatronLayout.from_hf_config(config)
    assert layout.qk_layernorm and not layout.qkv_bias
    m = mn.hf_to_megatron(hf, layout)
    assert torch.equal(m["decoder.layers.1." + mn.Q_NORM], hf["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(m["decoder.layers.1." + mn.K_NORM], hf["model.layers.1.self_attn.k_norm.weight"])


def test_unmapped_hf_tensor_is_an_error_naming_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama's attention_bias adds o_proj.bias too; Megatron's add_qkv_bias has no slot for it.
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
    )
    hf = LlamaForCausalLM(config).state_dict()
    with pytest.raises(mn.ConversionError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        mn.hf_to_megatron(hf, mn.MegatronLayout.from_hf_config(config))


def test_sliding_window_is_an_error():
    from transformers import MistralConfig, Qwen2Config

    with pytest.raises(mn.ConversionError, match="sliding_window=64"):
        mn.MegatronLayout.from_hf_config(
            MistralConfig(sliding_window=64, max_position_embeddings=256, num_hidden_layers=1)
        )
    with pytest.raises(mn.ConversionError, match="sliding_window=32"):
        mn.MegatronLayout.from_hf_config(
            Qwen2Config(use_sliding_window=True, sliding_window=32, max_position_embeddings=256, num_hidden_layers=1)
        )
    # Qwen2's sliding_window value is inert unless use_sliding_window is on; a window >= the context is no window.
    mn.MegatronLayout.from_hf_config(Qwen2Config(sliding_window=32, max_position_embeddings=256, num_hidden_layers=1))
    mn.MegatronLayout.from_hf_config(
        MistralConfig(sliding_window=256, max_position_embeddings=256, num_hidden_layers=1)
    )


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_exact(model, spec, tp, pp):
    config, hf = MODELS[model]()
    layout = mn.MegatronLayout.from_hf_config(config, spec=spec, tp_size=tp, pp_size=pp)
    shards = mn.to_megatron_shards(hf, layout)
    assert sorted(shards) == [(s, r) for s in range(pp) for r in range(tp)]
    _assert_bit_exact(mn.from_megatron_shards(shards, layout), hf)


def test_megatron_names_and_shapes():
    config, hf = _qwen2()
    layout = mn.MegatronLayout.from_hf_config(config)
    m = mn.hf_to_megatron(hf, layout)
    d, ng, qpg = 16, 2, 2
    assert layout.padded_vocab_size == 256 and m[mn.EMBED].shape == (256, 64)
    assert torch.equal(m[mn.EMBED][150:], torch.zeros(106, 64))
    assert mn.OUTPUT not in m  # tied embeddings
    assert m["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (ng * (qpg + 2) * d, 64)
    assert m["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (ng * (qpg + 2) * d,)
    assert m["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    assert "decoder.layers.0.input_layernorm.weight" in m and "decoder.layers.0.pre_mlp_layernorm.weight" in m
    te = mn.hf_to_megatron(hf, layout.replace(spec="te"))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert "decoder.layers.0.input_layernorm.weight" not in te


def test_qkv_is_interleaved_by_query_group():
    """Megatron's layout, written out: group g = [q heads of g, k head g, v head g], d rows each."""
    config, hf = _llama()
    layout = mn.MegatronLayout.from_hf_config(config)
    p = "model.layers.1.self_attn."
    q, k, v = (hf[p + f"{x}_proj.weight"] for x in "qkv")
    d, qpg = layout.head_dim, layout.heads_per_group
    rows = []
    for g in range(layout.num_query_groups):
        rows += [q[(g * qpg + j) * d : (g * qpg + j + 1) * d] for j in range(qpg)]
        rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    expected = torch.cat(rows)
    assert torch.equal(mn.hf_to_megatron(hf, layout)["decoder.layers.1.self_attention.linear_qkv.weight"], expected)


def test_tensor_parallel_shards_are_megatrons():
    config, hf = _llama()
    layout = mn.MegatronLayout.from_hf_config(config, tp_size=2)
    full = mn.hf_to_megatron(hf, layout)
    shards = mn.split_tensor_parallel(full, layout)
    p = "model.layers.2."
    for rank, shard in enumerate(shards):
        # QKV by query group: rank r holds groups 2r, 2r+1 (4 groups, tp 2) with their q, k and v heads.
        q, k, v = mn.split_qkv(shard["decoder.layers.2.self_attention.linear_qkv.weight"], layout, num_groups=2)
        d = layout.head_dim
        assert torch.equal(q, hf[p + "self_attn.q_proj.weight"][rank * 4 * d : (rank + 1) * 4 * d])
        assert torch.equal(k, hf[p + "self_attn.k_proj.weight"][rank * 2 * d : (rank + 1) * 2 * d])
        assert torch.equal(v, hf[p + "self_attn.v_proj.weight"][rank * 2 * d : (rank + 1) * 2 * d])
        # fc1: [gate_r; up_r], gate and up split separately.
        gate, up = torch.chunk(shard["decoder.layers.2.mlp.linear_fc1.weight"], 2)
        assert torch.equal(gate, hf[p + "mlp.gate_proj.weight"][rank * 48 : (rank + 1) * 48])
        assert torch.equal(up, hf[p + "mlp.up_proj.weight"][rank * 48 : (rank + 1) * 48])
        # row parallel along the input dim
        assert torch.equal(
            shard["decoder.layers.2.self_attention.linear_proj.weight"],
            hf[p + "self_attn.o_proj.weight"][:, rank * 32 : (rank + 1) * 32],
        )
        assert torch.equal(
            shard["decoder.layers.2.mlp.linear_fc2.weight"],
            hf[p + "mlp.down_proj.weight"][:, rank * 48 : (rank + 1) * 48],
        )
        # vocab parallel over the padded vocabulary (203 -> 256 = 128 * tp)
        assert layout.padded_vocab_size == 256
        assert shard[mn.EMBED].shape == (128, 64) and shard[mn.OUTPUT].shape == (128, 64)
        assert torch.equal(shard["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    assert torch.equal(shards[1][mn.EMBED][: 203 - 128], hf["model.embed_tokens.weight"][128:])


def test_pipeline_stages_use_local_layer_ids():
    config, hf = _llama(tie=True)
    layout = mn.MegatronLayout.from_hf_config(config, pp_size=2)
    stages = mn.split_pipeline(mn.hf_to_megatron(hf, layout), layout)
    assert layout.layer_offset(1) == 2
    assert {n.split(".")[2] for n in stages[1] if n.startswith("decoder.layers.")} == {"0", "1"}
    assert mn.EMBED in stages[0] and mn.EMBED not in stages[1]
    assert mn.OUTPUT in stages[1]  # tied: the last stage holds its own copy of the embedding
    assert torch.equal(stages[1]["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.2.mlp.down_proj.weight"])
    uneven = layout.replace(layers_per_stage=(1, 3))
    assert uneven.layer_offset(1) == 1
    _assert_bit_exact(mn.from_megatron_shards(mn.to_megatron_shards(hf, uneven), uneven), hf)


def test_wrong_pipeline_offset_is_caught_by_parity():
    """Exporting stage 1 without its layer offset: the classic gibberish-after-the-first-sync bug."""
    config, hf = _qwen2()
    layout = mn.MegatronLayout.from_hf_config(config, tp_size=2, pp_size=2)
    shards = mn.to_megatron_shards(hf, layout)
    stage0 = mn.export_stage_to_hf([shards[(0, r)] for r in range(2)], layout, 0)
    good1 = mn.export_stage_to_hf([shards[(1, r)] for r in range(2)], layout, 1)
    bad1 = mn.export_stage_to_hf([shards[(1, r)] for r in range(2)], layout, 1, layer_offset=0)
    engine = checksums(hf)
    assert compare(checksums({**stage0, **good1}), engine).ok

    # The trainer's view: what it sent, against the engine's weights.
    report = compare(checksums({**stage0, **bad1}), engine)
    assert not report.ok
    assert "model.layers.0.self_attn.q_proj.weight" in report.mismatched
    assert "model.layers.2.self_attn.q_proj.weight" in report.unexpected_in_engine
    assert "model.layers.0." in report.first_problem

    # The engine's view after loading that sync: layer 0 holds layer 2's weights.
    synced = dict(hf)
    synced.update(bad1)
    report = compare(checksums({**stage0, **good1}), checksums(synced))
    assert report.mismatched and all(n.startswith(("model.layers.0.", "model.layers.1.")) for n in report.mismatched)
    assert "model.layers.0.mlp.down_proj.weight" in report.summary() or report.first_problem.startswith("mismatch")

    # A stage-local name map fixes names exported without the offset.
    fixed = {mn.hf_layer_name_map(2)(k): v for k, v in bad1.items() if k.startswith("model.layers.")}
    assert compare(
        checksums({**stage0, **fixed, **{k: v for k, v in good1.items() if not k.startswith("model.layers.")}}), engine
    ).ok


def test_bad_layouts_are_rejected():
    config, _ = _llama()
    with pytest.raises(mn.ConversionError, match="num_query_groups=4"):
        mn.MegatronLayout.from_hf_config(config, tp_size=8)
    with pytest.raises(mn.ConversionError, match="pp_size=3"):
        mn.MegatronLayout.from_hf_config(config, pp_size=3)
    layout = mn.MegatronLayout.from_hf_config(config)
    te = mn.hf_to_megatron(_llama()[1], layout.replace(spec="te"))
    with pytest.raises(mn.ConversionError, match="'te' layer spec"):
        mn.megatron_to_hf(te, layout)
