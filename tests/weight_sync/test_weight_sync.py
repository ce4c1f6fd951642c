"""Weight sync from a sharded Megatron trainer to forge-engine (0 GPUs; 1-4 gloo trainer ranks + CPU engines).

A TP=2 / PP=2 / EP=2 trainer loaded from a forge-convert checkpoint scores tokens like the HF original. After a
sync from such a trainer whose weights moved away from the engine's, the engine's logprobs of
its own greedy continuation equal the trainer's (<= 1e-5), for the distributed (broadcast) and the disk transport;
the gateway is paused during the sync and resumed with the new policy version; an engine killed between buckets is
excluded (the others get every tensor and the new version) and is re-synced
once it is back; bad configs fail with messages that name the field.
"""

import json
import os
import urllib.request

import pytest
import torch

from forge_megatron.bridge import ParallelLayout
from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.mcore.parallel import ParallelConfig
from forge_megatron.utils.ports import free_port
from forge_megatron.weight_sync import WeightSyncConfig
from tests.convert.mcore_forward import forward_logits, load_converted
from tests.dist_utils import run_distributed

PROMPT = [5, 17, 42, 99, 7, 256, 31, 64]
NEW = 5
TAIL = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ws")
    return {
        "qwen2": build_tiny_model(str(root / "qwen2"), arch="qwen2", seed=3),
        "qwen3_tied": build_tiny_model(str(root / "qwen3_tied"), arch="qwen3", seed=4, tie_word_embeddings=True),
        "qwen3_moe": build_tiny_model(str(root / "qwen3_moe"), arch="qwen3_moe", seed=5),
        "glm4_moe": build_tiny_model(str(root / "glm4_moe"), arch="glm4_moe", seed=6),
        "deepseek_v3": build_tiny_model(str(root / "deepseek_v3"), arch="deepseek_v3", seed=7),
        "gpt_oss": build_tiny_model(str(root / "gpt_oss"), arch="gpt_oss", seed=8),
        "minimax_m2": build_tiny_model(str(root / "minimax_m2"), arch="minimax_m2", seed=9),
        "qwen3_5": build_tiny_model(str(root / "qwen3_5"), arch="qwen3_5", seed=10),
        "olmo3": build_tiny_model(str(root / "olmo3"), arch="olmo3", seed=11),
        "gemma3": build_tiny_model(str(root / "gemma3"), arch="gemma3", seed=12),
        "gemma3_vl": build_tiny_model(str(root / "gemma3_vl"), arch="gemma3_vl", seed=13),
        "qwen3_vl": build_tiny_model(str(root / "qwen3_vl"), arch="qwen3_vl", seed=14),
        "glm4": build_tiny_model(str(root / "glm4"), arch="glm4", seed=15),
        "qwen3_vl_moe": build_tiny_model(str(root / "qwen3_vl_moe"), arch="qwen3_vl_moe", seed=16),
        "kimi_k25": build_tiny_model(str(root / "kimi_k25"), arch="kimi_k25", seed=17),
        "glm4v_moe": build_tiny_model(str(root / "glm4v_moe"), arch="glm4v_moe", seed=18),
        "ministral3_vl": build_tiny_model(str(root / "ministral3_vl"), arch="ministral3_vl", seed=19),
        "deepseek_v32": build_tiny_model(str(root / "deepseek_v32"), arch="deepseek_v32", seed=20),
        "glm_moe_dsa": build_tiny_model(str(root / "glm_moe_dsa"), arch="glm_moe_dsa", seed=21),
        "mistral4_vl": build_tiny_model(str(root / "mistral4_vl"), arch="mistral4_vl", seed=22),
        "olmo_hybrid": build_tiny_model(str(root / "olmo_hybrid"), arch="olmo_hybrid", seed=24),
        "kimi_linear": build_tiny_model(str(root / "kimi_linear"), arch="kimi_linear", seed=25),
        "gemma4": build_tiny_model(str(root / "gemma4"), arch="gemma4", seed=26),
        "gemma4_vl": build_tiny_model(str(root / "gemma4_vl"), arch="gemma4_vl", seed=27),
        "llama4": build_tiny_model(str(root / "llama4"), arch="llama4", seed=28, interleave_moe_layer_step=2),
        "gemma2": build_tiny_model(str(root / "gemma2"), arch="gemma2", seed=29),
        "granitemoe_swa": build_tiny_model(str(root / "granitemoe_swa"), arch="granitemoe_swa", seed=30),
        "exaone4_5": build_tiny_model(str(root / "exaone4_5"), arch="exaone4_5", seed=31),
        "cohere2_moe": build_tiny_model(str(root / "cohere2_moe"), arch="cohere2_moe", seed=32),
        "bamba": build_tiny_model(str(root / "bamba"), arch="bamba", seed=33),
        "apertus": build_tiny_model(str(root / "apertus"), arch="apertus", seed=34),
        "falcon_h1": build_tiny_model(str(root / "falcon_h1"), arch="falcon_h1", seed=35),
        "afmoe": build_tiny_model(str(root / "afmoe"), arch="afmoe", seed=36),
        "qwen2_5_vl": build_tiny_model(str(root / "qwen2_5_vl"), arch="qwen2_5_vl", seed=30),
        "gemma4_moe": build_tiny_model(str(root / "gemma4_moe"), arch="gemma4_moe", seed=28),
        "gemma4_e": build_tiny_model(str(root / "gemma4_e"), arch="gemma4_e", seed=29),
        "deepseek_v3_3l": build_tiny_model(str(root / "deepseek_v3_3l"), arch="deepseek_v3", seed=23,
                                           num_hidden_layers=3),
        "ernie4_5_moe": build_tiny_model(str(root / "ernie4_5_moe"), arch="ernie4_5_moe", seed=31),
        "hunyuan_v1_dense": build_tiny_model(str(root / "hunyuan_v1_dense"), arch="hunyuan_v1_dense", seed=37),
        "hunyuan_v1_moe": build_tiny_model(str(root / "hunyuan_v1_moe"), arch="hunyuan_v1_moe", seed=41),
        "olmoe": build_tiny_model(str(root / "olmoe"), arch="olmoe", seed=43),
        "mimo_v2_flash": build_tiny_model(str(root / "mimo_v2_flash"), arch="mimo_v2_flash", seed=47),
        "minimax_m3": build_tiny_model(str(root / "minimax_m3"), arch="minimax_m3", seed=53),
        "minimax_m3_text": build_tiny_model(str(root / "minimax_m3_text"), arch="minimax_m3_text", seed=59),
        "longcat_flash": build_tiny_model(str(root / "longcat_flash"), arch="longcat_flash", seed=61),
        "mixtral": build_tiny_model(str(root / "mixtral"), arch="mixtral", seed=67),
        "solar_open": build_tiny_model(str(root / "solar_open"), arch="solar_open", seed=71),
        "phi3": build_tiny_model(str(root / "phi3"), arch="phi3", seed=73),
        "qwen2_moe": build_tiny_model(str(root / "qwen2_moe"), arch="qwen2_moe", seed=79),
        "exaone_moe": build_tiny_model(str(root / "exaone_moe"), arch="exaone_moe", seed=89),
        "granitemoeshared": build_tiny_model(str(root / "granitemoeshared"), arch="granitemoeshared", seed=103),
        "granitemoehybrid_mamba": build_tiny_model(str(root / "granitemoehybrid_mamba"), arch="granitemoehybrid_mamba",
                                                   seed=107),
        "nemotron_h_moe": build_tiny_model(str(root / "nemotron_h_moe"), arch="nemotron_h_moe", seed=109),
        "nemotron_h_latent": build_tiny_model(str(root / "nemotron_h_latent"), arch="nemotron_h_latent", seed=110),
        "lfm2": build_tiny_model(str(root / "lfm2"), arch="lfm2", seed=113),
        "lfm2_moe": build_tiny_model(str(root / "lfm2_moe"), arch="lfm2_moe", seed=127),
        "axk1": build_tiny_model(str(root / "axk1"), arch="axk1", seed=131),
        "minicpm5_moe": build_tiny_model(str(root / "minicpm5_moe"), arch="minicpm5_moe", seed=137),
        "kolibri1": build_tiny_model(str(root / "kolibri1"), arch="kolibri1", seed=139),
        "lfm3": build_tiny_model(str(root / "lfm3"), arch="lfm3", seed=149),
        "minimax01": build_tiny_model(str(root / "minimax01"), arch="minimax01", seed=157),
        "laguna": build_tiny_model(str(root / "laguna"), arch="laguna", seed=163),
        "flint": build_tiny_model(str(root / "flint"), arch="flint", seed=167),
        "hy_v3": build_tiny_model(str(root / "hy_v3"), arch="hy_v3", seed=151),
    }


def _post(url, route, body):
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _engine_greedy(url, lora_path=None):
    """(output ids, their logprobs, weight_version) of a greedy continuation of PROMPT (with the LoRA adapter named
    ``lora_path``)."""
    out = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
                                   **({"lora_path": lora_path} if lora_path else {})})
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], lps, out["meta_info"]["weight_version"]


def _perturb(model, scale):
    """Move every weight by a deterministic function of its value (identical on replicas of a parameter)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.sin(p * 1000.0))
        for name, buf in model.named_buffers():  # MoE routers' score-correction biases are synced too
            if name.endswith(".expert_bias"):
                buf.add_(scale * torch.sin(buf * 1000.0 + 1.0))


def _trainer_logprobs(model, output_ids):
    """Trainer logprobs of ``output_ids`` after PROMPT (on the last stage; None elsewhere)."""
    ids = torch.tensor([PROMPT + list(output_ids)])
    logits = forward_logits(model, ids)
    if logits is None:
        return None
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(output_ids)]


def _engine_vs_trainer(model, url, lora_path=None):
    """Engine greedy output (``lora_path``: with that adapter) broadcast to every rank, then the trainer's logprobs
    for it. Collective."""
    from megatron.core import parallel_state as ps

    ids = torch.zeros(NEW, dtype=torch.int64)
    engine = None
    if torch.distributed.get_rank() == 0:
        out, lps, version = _engine_greedy(url, lora_path)
        ids = torch.tensor(out)
        engine = (lps, version)
    torch.distributed.broadcast(ids, src=0)
    mine = _trainer_logprobs(model, ids.tolist())
    # Rank 0's model replica (DP rank 0, TP rank 0) answers; other DP replicas (e.g. EP=2 with DP=2) stay quiet.
    first_replica = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    last_rank = ps.get_pipeline_model_parallel_last_rank() if first_replica else None
    if torch.distributed.get_rank() == 0 and last_rank != 0:  # engine answer is on rank 0, trainer's on the last stage
        got = torch.empty(NEW, dtype=torch.float64)
        torch.distributed.recv(got, src=last_rank)
        mine = got.tolist()
    elif mine is not None and torch.distributed.get_rank() == last_rank and last_rank != 0:
        torch.distributed.send(torch.tensor(mine, dtype=torch.float64), dst=0)
    return engine, mine


def _sync(model, bridge, version, bucket_bytes=40_000, **cfg):
    from forge_megatron.weight_sync import WeightSyncer

    syncer = WeightSyncer(WeightSyncConfig(bucket_bytes=bucket_bytes, timeout_s=60, **cfg), bridge)
    try:
        report = syncer.sync([model], policy_version=version)
    finally:
        syncer.close()
    assert report.policy_version == version, report  # fail fast instead of generating on a paused engine
    return report


def sync_ep2_trainer_to(hf_dir: str, served_dir: str, tmp_path, **quantization):
    """An EP=2 trainer converted from ``hf_dir`` syncs (``fp8=`` / ``int4=``) to a forge-engine serving
    ``served_dir``: :func:`_quantized_sync_body`'s results, rank by rank."""
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(hf_dir, mcore, ParallelLayout(ep=2))
    engine = start_engine(served_dir, in_process=True)
    try:
        return run_distributed(_quantized_sync_body, world_size=2, parallel=ParallelConfig(ep=2), mcore_dir=mcore,
                               engine_url=engine.url, disk_dir=str(tmp_path / "disk"),
                               export_root=str(tmp_path / "export"), **quantization)
    finally:
        engine.stop()


def _quantized_sync_body(rank, world_size, mcore_dir, engine_url, disk_dir, export_root, **quantization):
    """For a quantized sync (``fp8=`` / ``int4=``), over the broadcast then the disk transport: move the weights,
    write what the trainer holds in full precision to ``export_root/<transport>`` (rank 0), sync, and return per
    transport (report, the engine's greedy ids, (engine logprobs and version, trainer logprobs of them))."""
    from safetensors.torch import save_file

    from forge_megatron.weight_sync.gather import is_stage_lead, iter_stage_buckets

    bridge, model = load_converted(mcore_dir)
    results = {}
    for version, transport in ((1, "distributed"), (2, "disk")):
        _perturb(model, 0.05)
        exported = {}  # the trainer's weights, full precision, as HF tensors
        for bucket in iter_stage_buckets(bridge, [model], bucket_bytes=40_000):
            if is_stage_lead():
                exported.update((n, t.clone()) for n, t in bucket)
        if rank == 0:
            out = os.path.join(export_root, transport)
            os.makedirs(out)
            save_file(exported, os.path.join(out, "model.safetensors"))
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(bridge.hf_config, f)
        report = _sync(model, bridge, version, engine_urls=[engine_url], transport=transport, disk_dir=disk_dir,
                       **quantization)
        ids = _engine_greedy(engine_url)[0] if rank == 0 else None  # greedy: the tokens scored below
        results[transport] = (report, ids, _engine_vs_trainer(model, engine_url))
    return results


def _sync_body(rank, world_size, mcore_dir, engine_url, disk_dir, gateway_url, bucket_bytes):
    bridge, model = load_converted(mcore_dir)
    results = {"converted": _engine_vs_trainer(model, engine_url)}  # the engine serves the HF original
    _perturb(model, 0.05)
    results["before"] = _engine_vs_trainer(model, engine_url)
    for version, transport in ((1, "distributed"), (2, "disk")):
        report = _sync(model, bridge, version, engine_urls=[engine_url], transport=transport, disk_dir=disk_dir,
                       gateway_url=gateway_url, bucket_bytes=bucket_bytes)
        results[transport] = (report, _engine_vs_trainer(model, engine_url))
        if rank == 0:
            with urllib.request.urlopen(gateway_url + "/forge/admin/state", timeout=10) as resp:
                results[transport + "_gateway"] = json.loads(resp.read())
        _perturb(model, 0.05)
    return results


def _check_synced(results):
    r0 = results[0]
    (lps_hf, _), trainer_converted = r0["converted"]
    assert max(abs(a - b) for a, b in zip(lps_hf, trainer_converted)) <= 1e-5  # the sharded conversion is exact
    (lps_before, _), trainer_before = r0["before"]
    assert max(abs(a - b) for a, b in zip(lps_before, trainer_before)) > 1e-3  # the trainer really moved
    for version, transport in ((1, "distributed"), (2, "disk")):
        report, ((lps, engine_version), trainer) = r0[transport]
        assert report.policy_version == version and engine_version == str(version)
        assert report.excluded == [] and len(report.updated) == 1 and report.bytes > 0 and report.buckets > 1
        diff = max(abs(a - b) for a, b in zip(lps, trainer))
        assert diff <= 1e-5, (transport, diff)
        gateway = r0[transport + "_gateway"]
        assert gateway["policy_version"] == version and gateway["paused"] is False


@pytest.mark.parametrize("arch,parallel", [
    ("qwen2", ParallelConfig(tp=2)),
    ("qwen3_tied", ParallelConfig(pp=2)),
    ("qwen3_moe", ParallelConfig(ep=2)),
    ("glm4_moe", ParallelConfig(pp=2)),
    ("deepseek_v3", ParallelConfig(tp=2)),  # MLA: up projections gathered over TP, latents replicated
    ("gpt_oss", ParallelConfig(ep=2)),  # every expert of a layer in one HF tensor (SGLang's gpt-oss loader's names)
    ("minimax_m2", ParallelConfig(tp=2)),  # q/k norm slices gathered over TP; Mixtral names (block_sparse_moe, w1..3)
    ("qwen3_5", ParallelConfig(tp=2)),  # Gated DeltaNet projections gathered over TP and split back into HF's four
    # experts whole (expert TP 1), the EP group over the TP ranks: attention gathered over TP, experts over EP
    ("gpt_oss", ParallelConfig(tp=2, ep=2, etp=1)),
    ("olmo3", ParallelConfig(tp=2)),  # the norms after attention and MLP, q/k norms over all heads (TP slices)
    ("gemma3", ParallelConfig(pp=2)),  # sandwich norms; the tied embedding sent once, from the first stage
    # as released: the engine serves the vision-language model; the language model's names as on disk
    # (language_model.model.*), the vision tower left as it is
    ("gemma3_vl", ParallelConfig(tp=2)),
    ("qwen3_vl", ParallelConfig(pp=2)),  # an engine serving the whole vision-language model (no text-only class)
    ("glm4", ParallelConfig(tp=2)),  # the gate/up halves gathered over TP back into GLM-4's one tensor
    # every expert of a layer in one transposed tensor, gathered over EP (SGLang loads them only whole)
    ("qwen3_vl_moe", ParallelConfig(ep=2)),
    ("kimi_k25", ParallelConfig(tp=2)),  # MLA under language_model.model.*, the head language_model.lm_head
    ("glm4v_moe", ParallelConfig(pp=2)),  # GLM-4.5V: its dense and MoE layers on different stages
    ("ministral3_vl", ParallelConfig(tp=2)),  # language_model.model.*, the head language_model.lm_head; query scaling
    # DeepSeek sparse attention: the indexer (replicated) synced with the layer; the engine's sparse attention after
    ("deepseek_v32", ParallelConfig(tp=2)),
    ("glm_moe_dsa", ParallelConfig(ep=2)),  # GLM-5: layer 1 shares layer 0's selection (no indexer tensors)
    # Mistral Small 4 as released: each layer's experts stacked in two tensors, gathered over EP (sent whole)
    ("mistral4_vl", ParallelConfig(ep=2)),
    # uneven pipeline stages: 3 layers, the last stage one of them (each stage names its own layers)
    ("deepseek_v3_3l", ParallelConfig(pp=2, last_stage_layers=1)),
    # OLMo Hybrid as released: the convolution in three tensors, the linear layers' own norm names (the engine
    # writes them into transformers' one convolution and renamed norms)
    ("olmo_hybrid", ParallelConfig(tp=2)),
    # Kimi Linear as released: Kimi Delta Attention's heads and gates gathered over TP (the convolution in three,
    # the forget gate's tensors under self_attn.), experts one by one under block_sparse_moe
    ("kimi_linear", ParallelConfig(tp=2)),
    # Gemma 4: the global layer's q/k (its values are the keys) gathered over TP and split with its own geometry
    ("gemma4", ParallelConfig(tp=2)),
    ("gemma4_vl", ParallelConfig(pp=2)),  # as released: model.language_model.*, the vision tower left as it is
    # Gemma 4 26B-A4B: each layer's experts stacked in two tensors directly under the layer, gathered over EP; the
    # router's projection and scales under router.*, the dense branch under mlp.*
    ("gemma4_moe", ParallelConfig(ep=2)),
    # Gemma 4 E2B / E4B: the per-layer inputs' table and gates (replicated), the KV-shared layers' q_proj alone
    ("gemma4_e", ParallelConfig(tp=2)),
    # Qwen2.5-VL as released (what SGLang's loader reads): the language model under model.*, the engine serving the
    # whole model (transformers holds it under model.language_model.*); a flat config.json
    ("qwen2_5_vl", ParallelConfig(tp=2)),
    # ERNIE 4.5 MoE: experts one by one over EP, the score-correction bias back to its [1, E] under moe_statics
    ("ernie4_5_moe", ParallelConfig(ep=2)),
    # Hunyuan: q/k norms after RoPE (query_layernorm / key_layernorm), the MoE one's gate.wg and shared_mlp over EP
    ("hunyuan_v1_dense", ParallelConfig(tp=2)), ("hunyuan_v1_moe", ParallelConfig(ep=2)),
    # OLMoE: q/k norms over all heads (each TP rank's slice gathered whole), experts one by one
    ("olmoe", ParallelConfig(tp=2)),
    # MiMo-V2-Flash: per-kind q/k/v split with narrower values, the sliding layer's sinks split over TP with the heads
    ("mimo_v2_flash", ParallelConfig(tp=2)),
    # MiniMax-M3 as released: experts one by one under block_sparse_moe (w1 / w3 / w2) and the shared expert's and
    # dense MLP's gate / up written into transformers' fused tensors, the indexers replicated, the tower left as it is
    ("minimax_m3", ParallelConfig(tp=2)),
    ("minimax_m3_text", ParallelConfig(ep=2)),  # transformers' names: each layer's stacked experts gathered over EP
    # LongCat-Flash: each Megatron layer pair back to one checkpoint layer's sublayer names (self_attn.{0,1},
    # mlps.{0,1}), experts one by one over EP into transformers' stacked tensors, the router's identity rows
    ("longcat_flash", ParallelConfig(tp=2, ep=2, etp=1)),
    # Mixtral: experts one by one under block_sparse_moe (w1 / w3 / w2) over EP into transformers' fused tensors
    ("mixtral", ParallelConfig(ep=2)),
    ("solar_open", ParallelConfig(tp=2)),  # GLM-4.5's MoE names in every layer, the score bias replicated
    ("phi3", ParallelConfig(tp=2)),  # qkv_proj / gate_up_proj gathered over TP into the engine's fused tensors
    ("qwen2_moe", ParallelConfig(ep=2)),  # experts over EP, the shared expert and its gate
    ("exaone_moe", ParallelConfig(ep=2)),  # experts over EP, the score bias beside the gate
    ("granitemoeshared", ParallelConfig(ep=2)),  # stacked experts over EP into transformers' fused tensors
    # Granite 4.0-H: the Mamba-2 layer's per-group projection, convolution and per-head tensors gathered over TP
    ("granitemoehybrid_mamba", ParallelConfig(tp=2)),
    # Nemotron 3 Nano's layout: backbone.* names, experts one by one into transformers' stacked tensors, over TP and EP
    ("nemotron_h_moe", ParallelConfig(tp=2, ep=2, etp=1)),
    # Nemotron 3 Super's LatentMoE: the latent projections sent once (whole on every rank), latent experts over EP
    ("nemotron_h_latent", ParallelConfig(tp=2, ep=2, etp=1)),
    ("lfm2", ParallelConfig(tp=2)),  # the short convolutions' per-channel projection gathered back to [B; C; x]
    ("lfm2_moe", ParallelConfig(ep=2)),  # experts one by one (w1 / w3 / w2) into transformers' fused tensors
    # Llama 4 Maverick's layout: each MoE layer's experts in two transposed tensors gathered over EP, the router and
    # shared expert under feed_forward.*, the dense layer's MLP there too
    ("llama4", ParallelConfig(ep=2)),
    # Gemma 2: the engine's transformers model caps its scores (eager attention) as the trainer's tree kernels do
    ("gemma2", ParallelConfig(tp=2)),
    # Granite MoE SWA: the sinks gathered over TP with the heads, experts under transformers' stacked names
    ("granitemoe_swa", ParallelConfig(tp=2)),
    # EXAONE 4.5 as released: the engine serves the vision-language model, the language model's names under
    # model.language_model.*, the tower left as it is
    ("exaone4_5", ParallelConfig(tp=2)),
    # Command A+ (Cohere2-MoE): one norm per layer, the dense first layer's MLP, experts one by one over EP into
    # transformers' fused tensors, the shared expert gathered over TP
    ("cohere2_moe", ParallelConfig(tp=2, ep=2, etp=1)),
    # Bamba: Granite 4.0-H's Mamba-2 tensors gathered over TP under Bamba's names (feed_forward, pre_ff_layernorm)
    ("bamba", ParallelConfig(tp=2)),
    # Apertus: each layer's xIELU scalars (replicated: sent once) into the engine's act_fn; its constants stay
    ("apertus", ParallelConfig(tp=2)),
    # Falcon-H1: the attention and the Mamba-2 mixer of every layer gathered over TP (mamba.*, self_attn.*)
    ("falcon_h1", ParallelConfig(tp=2)),
    # AFMoE: q / gate / k / v split back from Megatron's gated projection, the router's bias beside it, experts
    # one by one over EP into transformers' fused tensors
    ("afmoe", ParallelConfig(tp=2, ep=2, etp=1)),
    # A.X K1: the norm after the experts (post_mlp_layernorm on disk) into the engine's mlp.post_mlp_layernorm
    ("axk1", ParallelConfig(ep=2)),
    # MiniCPM5-MoE: each head's queries and gate gathered over TP back into q_proj (the engine's q_gate_proj)
    ("minicpm5_moe", ParallelConfig(tp=2)),
    # Kolibri 1: its released names (post_attn_norm, post_ffn_norm, moe.router.expert_bias) into transformers' ones
    ("kolibri1", ParallelConfig(ep=2)),
    # LFM3: the gate per head gathered over TP (gate_proj as released, the engine's g_proj), the sandwich norms
    ("lfm3", ParallelConfig(tp=2)),
    # Hy3: its released names (mlp.router.gate, mlp.expert_bias, mlp.shared_mlp) into transformers' ones, over EP
    ("hy_v3", ParallelConfig(ep=2)),
    # MiniMax-M1: the lightning layers' per-head q/k/v, output gate and all-heads norm gathered over TP; the experts
    # into transformers' fused ones
    ("minimax01", ParallelConfig(tp=2)),
    # Laguna: each layer's own query heads and gate rows gathered over TP; the experts' bias into the gate's
    ("laguna", ParallelConfig(tp=2)),
    # Flint: the sinks gathered over TP (softmax_offset as released, transformers' sinks)
    ("flint", ParallelConfig(tp=2)),
], ids=["tp2", "pp2-tied", "ep2-moe", "pp2-glm4-moe", "tp2-deepseek-v3", "ep2-gpt-oss", "tp2-minimax-m2",
        "tp2-qwen3-5", "tp2ep2etp1-gpt-oss", "tp2-olmo3", "pp2-gemma3", "tp2-gemma3-vl", "pp2-qwen3-vl", "tp2-glm4",
        "ep2-qwen3-vl-moe", "tp2-kimi-k25", "pp2-glm4v-moe",
        "tp2-ministral3-vl", "tp2-deepseek-v32", "ep2-glm-moe-dsa", "ep2-mistral4-vl", "pp2-uneven-deepseek-v3",
        "tp2-olmo-hybrid", "tp2-kimi-linear", "tp2-gemma4", "pp2-gemma4-vl", "ep2-gemma4-moe", "tp2-gemma4-e",
        "tp2-qwen2-5-vl", "ep2-ernie4-5-moe", "tp2-hunyuan-dense", "ep2-hunyuan-moe", "tp2-olmoe",
        "tp2-mimo-v2-flash", "tp2-minimax-m3", "ep2-minimax-m3-text", "tp2ep2etp1-longcat-flash",
        "ep2-mixtral", "tp2-solar-open", "tp2-phi3", "ep2-qwen2-moe", "ep2-exaone-moe", "ep2-granitemoeshared",
        "tp2-granite-4-h", "tp2ep2etp1-nemotron-h-moe", "tp2ep2etp1-nemotron-h-latent", "tp2-lfm2", "ep2-lfm2-moe", "ep2-llama4", "tp2-gemma2",
        "tp2-granitemoe-swa", "tp2-exaone4-5",
        "tp2ep2etp1-cohere2-moe", "tp2-bamba", "tp2-apertus", "tp2-falcon-h1",
        "tp2ep2etp1-afmoe", "ep2-axk1", "tp2-minicpm5-moe", "ep2-kolibri1", "tp2-lfm3", "ep2-hy-v3",
        "tp2-minimax01", "tp2-laguna", "tp2-flint"])
def test_sync_makes_engine_match_trainer(models, tmp_path, arch, parallel):
    from forge_megatron.rollout.launch import start_engine, start_gateway

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models[arch], mcore, ParallelLayout(parallel.tp, parallel.pp, parallel.ep, parallel.etp,
                                                            parallel.first_stage_layers, parallel.last_stage_layers))
    engine = start_engine(models[arch], in_process=True)
    gateway = start_gateway(models[arch], [engine.url], in_process=True)
    try:
        # DeepSeek-V3: buckets smaller than two query/key-value down projections (8 KiB each), which the engine (as
        # SGLang) must receive in one request: only keeping them together passes
        results = run_distributed(_sync_body, world_size=2, parallel=parallel, mcore_dir=mcore,
                                  engine_url=engine.url, disk_dir=str(tmp_path / "disk"), gateway_url=gateway.url,
                                  bucket_bytes=9_000 if arch == "deepseek_v3" else 40_000)
        groups = sorted(engine.engine.weight_groups)
    finally:
        gateway.stop()
        engine.stop()
    _check_synced(results)
    assert os.listdir(tmp_path / "disk") == ["policy_2"]  # older versions are cleaned up
    # One weight-update group per pipeline stage, each hosted by that stage's lead (nothing relayed through rank 0).
    assert [g.rsplit("_", 1)[1] for g in groups] == [f"s{s}" for s in range(parallel.pp)], groups


def _lora_sync_body(rank, world_size, mcore_dir, engine_url, disk_dir, targets):
    """--lora-rank's adapters on a converted trainer: with B moved off zero the trainer (base weights + adapters,
    through the linears' hooks) scores differently from the engine; a sync sends W + scaling * B A per TP shard
    and the engine then scores as the trainer does. Returns (adapted names, before, after, report)."""
    from forge_megatron.mcore.lora import LoraConfig, install

    bridge, model = load_converted(mcore_dir)
    adapted = install([model], LoraConfig(rank=4, alpha=8.0, targets=targets))
    with torch.no_grad():  # the same values on every rank holding a whole tensor (a function of the position)
        for name, p in model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.add_(0.2 * torch.cos(torch.arange(p.numel(), dtype=torch.float32) * 0.7).view_as(p).to(p.dtype))
    before = _engine_vs_trainer(model, engine_url)
    report = _sync(model, bridge, 1, engine_urls=[engine_url], transport="distributed", disk_dir=disk_dir)
    return adapted, before, _engine_vs_trainer(model, engine_url), report


@pytest.mark.parametrize("arch,parallel", [
    ("qwen2", ParallelConfig(tp=2)),  # column-parallel B / row-parallel A split over TP, merged per shard
    ("qwen3_tied", ParallelConfig(pp=2)),  # each stage merges its own layers' adapters
    ("qwen3_moe", ParallelConfig(ep=2)),  # attention adapted, the experts sent as they are
    # multi-latent attention: its up projections (column-parallel) and output adapted, the latents' down
    # projections not; layer 0's dense MLP adapted, layer 1's experts and shared expert not
    ("deepseek_v3", ParallelConfig(tp=2)),
    # --lora-target-modules all,experts,shared_experts: every routed expert merged on its EP rank, then gathered
    ("glm4_moe_experts", ParallelConfig(ep=2)),
    ("qwen3_moe_experts", ParallelConfig(tp=2)),  # the experts (and their adapters) split over TP, merged per shard
], ids=["tp2", "pp2", "ep2-moe", "tp2-mla", "ep2-experts", "tp2-experts"])
def test_lora_adapters_are_synced_merged_into_the_weights(models, tmp_path, arch, parallel):
    from forge_megatron.rollout.launch import start_engine

    from forge_megatron.mcore.lora import MOE, TARGETS

    experts = arch.endswith("_experts")
    arch = arch.removesuffix("_experts")
    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models[arch], mcore, ParallelLayout(parallel.tp, parallel.pp, parallel.ep))
    engine = start_engine(models[arch], in_process=True)
    try:
        results = run_distributed(_lora_sync_body, world_size=2, parallel=parallel, mcore_dir=mcore,
                                  engine_url=engine.url, disk_dir=str(tmp_path / "disk"),
                                  targets=TARGETS + (MOE if experts else ()))
    finally:
        engine.stop()
    adapted, ((lps_before, _), trainer_before), ((lps, version), trainer), report = results[0]
    # (a MoE layer's MLP is not adapted, unless named: GLM-4.5's layer 1 then has 2 of its 4 experts on this rank,
    # and a shared expert, fc1 and fc2 each)
    per_layer = {"qwen3_moe": [2 + 2 * 4 * experts] * 2, "deepseek_v3": [5, 3],
                 "glm4_moe": [4, 2 + 2 * 2 + 2]}.get(arch, [4, 4])
    assert len(adapted) == sum(per_layer[:2 // parallel.pp]), adapted
    assert max(abs(a - b) for a, b in zip(lps_before, trainer_before)) > 1e-3  # the adapters moved the trainer
    assert report.excluded == [] and version == "1"
    assert max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5


def test_tensors_sglang_fuses_on_load_travel_in_one_bucket(models):
    """q_a_proj and kv_a_proj_with_mqa of a layer (SGLang's DeepSeek loader fuses them within one load call) share a
    bucket however small the buckets, FP8 scales included; without keep_together they would not; the engine refuses
    a request holding one of them alone, naming the other."""
    from forge_megatron.rollout.engine_server import ReferenceEngine, RequestError
    from forge_megatron.weight_sync import buckets as bk
    from forge_megatron.weight_sync.fp8 import Fp8Config, quantize_named

    layer = "model.layers.1.self_attn."
    named = [(layer + "q_a_proj.weight", torch.ones(32, 64)), (layer + "q_a_layernorm.weight", torch.ones(32)),
             (layer + "q_b_proj.weight", torch.ones(96, 32)), (layer + "kv_a_proj_with_mqa.weight", torch.ones(32, 64)),
             ("model.norm.weight", torch.ones(64))]

    def bucket_of(buckets, suffix):
        return next(i for i, b in enumerate(buckets) for n, _ in b if n.endswith(suffix))

    plain = list(bk.make_buckets(iter(named), 9_000))
    assert bucket_of(plain, "q_a_proj.weight") != bucket_of(plain, "kv_a_proj_with_mqa.weight")  # the control
    for stream in (iter(named), quantize_named(iter(named), Fp8Config(block=(32, 32)))):
        kept = list(bk.make_buckets(bk.keep_together(stream), 9_000))
        together = kept[bucket_of(kept, "q_a_proj.weight")]
        assert {n[len(layer):] for n, _ in together} >= {"q_a_proj.weight", "kv_a_proj_with_mqa.weight"}
        sent = [n for b in kept for n, _ in b if not n.endswith("weight_scale_inv")]
        assert sorted(sent) == sorted(n for n, _ in named)  # nothing lost or repeated
    engine = ReferenceEngine(models["deepseek_v3"])
    alone = {layer + "q_a_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(RequestError, match=r"'model.layers.1.self_attn.kv_a_proj_with_mqa.weight' must come in the same "
                                           r"request"):
        engine.load_state(alone)
    engine.load_state({**alone, layer + "kv_a_proj_with_mqa.weight": torch.zeros(32, 64)})
    assert engine.model.state_dict()[layer + "q_a_proj.weight"].abs().sum() == 0


def _moe_export_body(rank, world_size, mcore_dir, out_dir):
    """Every expert reaches rank 0 under its global id; rank 0 writes what an engine would receive."""
    from safetensors.torch import save_file

    from forge_megatron.weight_sync.gather import is_stage_lead, iter_stage_buckets

    bridge, model = load_converted(mcore_dir)
    converted = _trainer_logprobs(model, TAIL)
    _perturb(model, 0.05)
    names, received = [], {}
    for bucket in iter_stage_buckets(bridge, [model], bucket_bytes=40_000):
        if is_stage_lead():  # the others only take part in the gathers
            names += [n for n, _ in bucket]
            received.update((n, t.clone()) for n, t in bucket)
    if rank == 0:
        save_file(received, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(bridge.hf_config, f)
    return names, converted, _trainer_logprobs(model, TAIL)


def test_tp2_ep2_moe_experts_gathered_with_global_ids(models, tmp_path):
    """The TP=2 x EP=2 trainer's tensors (expert-TP gather, then EP gather; DP=2 so half the ranks only help), loaded by transformers (which maps SGLang's per-expert checkpoint names onto its
    fused experts) and by forge-engine's loader (same per-expert names), give the trainer's logprobs."""
    from forge_megatron.rollout.engine_server import ReferenceEngine
    from safetensors.torch import load_file

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen3_moe"], mcore, ParallelLayout(tp=2, ep=2))
    (names, converted, trainer), *others = run_distributed(_moe_export_body, world_size=4,
                                                           parallel=ParallelConfig(tp=2, ep=2),
                                                           mcore_dir=mcore, out_dir=str(tmp_path))
    assert all(o[0] == [] for o in others)  # only rank 0 leads the (only) stage
    reference = load_file(os.path.join(models["qwen3_moe"], "model.safetensors"))
    assert sorted(names) == sorted(reference)  # all 4 experts of every layer, each once, HF checkpoint names
    assert [n for n in names if ".experts." in n] == names[-len([n for n in names if ".experts." in n]):]
    for hf_dir, want in ((models["qwen3_moe"], converted), (str(tmp_path), trainer)):  # before / after the update
        got = _hf_logprobs(hf_dir)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, hf_dir
    engine = ReferenceEngine(models["qwen3_moe"])
    try:
        engine.load_from_disk(str(tmp_path))  # per-expert names -> fused expert tensors
        got = _hf_logprobs(None, model=engine.model)
    finally:
        engine.worker.shutdown()
    assert max(abs(a - b) for a, b in zip(got, trainer)) <= 1e-5


def _hf_logprobs(hf_dir, model=None):
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + TAIL])).logits[0].double(), dim=-1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(TAIL)]


# ------------------------------------------------------------------------------------------ engine failures
def _kill_body(rank, world_size, mcore_dir, model_dir, urls, victim_pid, victim_port):
    import signal

    from forge_megatron.rollout.launch import ProcessServer
    from forge_megatron.weight_sync import WeightSyncer

    bridge, model = load_converted(mcore_dir)
    _perturb(model, 0.05)
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=urls, bucket_bytes=40_000, timeout_s=60), bridge)
    killed, stages = [], []
    last_stage = world_size - 1  # PP = world_size here: kill while the last stage's lead is sending

    def kill_after_first(index, meta):
        stages.append(meta["stage"])
        if meta["stage"] == last_stage and not killed:
            os.killpg(victim_pid, signal.SIGKILL)
            killed.append(index)

    out = {}
    try:
        out["first"] = syncer.sync([model], 1, on_bucket=kill_after_first)
        out["stages"] = stages
        out["survivor"] = _engine_vs_trainer(model, urls[0])
        out["while_down"] = syncer.sync([model], 2)
        restarted = None
        if rank == 0:  # the other ranks only take part in the syncs' gathers
            restarted = ProcessServer("forge_megatron.rollout.engine_server",
                                      ["--model-path", model_dir, "--port", str(victim_port)])
        try:
            _perturb(model, 0.05)
            out["resync"] = syncer.sync([model], 3)
            out["restarted"] = _engine_vs_trainer(model, urls[1])
            out["survivor3"] = _engine_vs_trainer(model, urls[0])
        finally:
            if restarted is not None:
                restarted.stop()
    finally:
        syncer.close()
    return out


def test_engine_killed_during_sync_is_excluded_then_resynced(models, tmp_path):
    """PP = 2: the engine dies while stage 1's lead sends: stage 1 stops, rank 0 retries with new groups on both
    stages for the survivor, and later re-syncs the restarted engine over both stages' groups (with one stage the
    same steps, on one group)."""
    pp = 2
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout(pp=pp))
    keep = start_engine(models["qwen2"], in_process=True)
    # A subprocess that the trainer kills mid-sync and the test restarts on the same port: free_port draws it from
    # outside the ephemeral range, which the new groups' stores and connections draw from after the kill.
    victim = start_engine(models["qwen2"], extra_args=["--port", str(free_port())])
    try:
        out, *_ = run_distributed(_kill_body, world_size=pp, parallel=ParallelConfig(pp=pp), mcore_dir=mcore,
                                  model_dir=models["qwen2"], urls=[keep.url, victim.url],
                                  victim_pid=victim.proc.pid, victim_port=victim.port)
        groups = sorted(keep.engine.weight_groups)
    finally:
        keep.stop()
        victim.kill()
    # Pass 1 sent stage by stage up to the last stage's first bucket, then failed; pass 2 sent every stage again.
    stages = out["stages"]
    k = stages.index(pp - 1)
    assert stages[:k + 1] == sorted(stages[:k + 1]) and stages[k + 1] == 0
    assert stages[k + 1:] == sorted(stages[k + 1:]) and stages[-1] == pp - 1
    # Generations: pass 1 (both engines), pass 2 (survivor), sync 3 (both again), each with a group per stage; each
    # new generation had the engines destroy the groups of the old ones (/destroy_weights_update_group).
    assert len(groups) == pp and {g.rsplit("_", 1)[1] for g in groups} == {f"s{s}" for s in range(pp)}, groups
    assert len({g.rsplit("_", 2)[1] for g in groups}) == 1 and groups[0].rsplit("_", 2)[1] == "3", groups
    first = out["first"]
    assert first.excluded == [victim.url] and first.updated == [keep.url]
    assert first.policy_version == 1 and first.attempts == 2
    (lps, version), trainer = out["survivor"]
    assert version == "1" and max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5
    assert out["while_down"].excluded == [victim.url] and out["while_down"].policy_version == 2
    resync = out["resync"]
    assert resync.excluded == [] and sorted(resync.updated) == sorted([keep.url, victim.url])
    assert resync.policy_version == 3 and resync.attempts == 1
    for key in ("restarted", "survivor3"):
        (lps, version), trainer = out[key]
        assert version == "3" and max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5, key


def _pause_failure_body(rank, world_size, mcore_dir, url):
    from forge_megatron.weight_sync import WeightSyncer

    bridge, model = load_converted(mcore_dir)
    _perturb(model, 0.05)
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[url], bucket_bytes=40_000, timeout_s=30), bridge)
    out = {}
    try:
        out["failed"] = syncer.sync([model], 1)  # the engine's first /pause_generation answers 500
        out["still_serving"] = _engine_greedy(url)  # would time out if the engine had been left paused
        out["resync"] = syncer.sync([model], 2)
        out["after"] = _engine_vs_trainer(model, url)
    finally:
        syncer.close()
    return out


def test_engine_failing_to_pause_keeps_serving_then_resyncs(models, tmp_path):
    """An engine whose pause fails (HTTP 500; here its cache flush raises once) received no weights: it is excluded,
    resumed at once so that rollouts go on with the previous weights (left paused, a one-engine fleet would stall
    with the trainer waiting for a batch), and the next sync takes it back and updates it."""
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore)
    engine = start_engine(models["qwen2"], in_process=True)
    flush, failures = engine.engine.flush_cache, []

    def flush_failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected flush failure")
        flush()

    engine.engine.flush_cache = flush_failing_once
    try:
        (out,) = run_distributed(_pause_failure_body, world_size=1, mcore_dir=mcore, url=engine.url)
    finally:
        engine.stop()
    failed = out["failed"]
    assert failed.excluded == [engine.url] and failed.updated == [] and failed.policy_version is None
    ids, lps, version = out["still_serving"]
    assert len(ids) == NEW and version != "1"  # generating, with the weights it had
    resync = out["resync"]
    assert resync.excluded == [] and resync.updated == [engine.url] and resync.policy_version == 2
    (lps, version), trainer = out["after"]
    assert version == "2" and max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5


def _lead_failure_body(rank, world_size, mcore_dir, url, disk_dir):
    from forge_megatron.weight_sync import WeightSyncer
    from forge_megatron.weight_sync.transport import StageSender

    bridge, model = load_converted(mcore_dir)
    _perturb(model, 0.05)
    if rank == 1:  # stage 1's lead fails to write its second bucket, once
        deliver, calls = StageSender._deliver, []

        def failing(self, bucket, reply):
            calls.append(1)
            if len(calls) == 2:
                raise OSError("injected: disk full")
            return deliver(self, bucket, reply)

        StageSender._deliver = failing
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[url], transport="disk", disk_dir=disk_dir,
                                           bucket_bytes=40_000, timeout_s=30), bridge)
    out = {}
    try:
        out["failed"] = syncer.sync([model], 1)
        out["resync"] = syncer.sync([model], 2)
        out["after"] = _engine_vs_trainer(model, url)
    finally:
        syncer.close()
    return out


def test_stage_lead_failure_fails_the_sync_on_every_rank_then_resyncs(models, tmp_path):
    """PP = 2, disk transport: stage 1's lead fails to write a bucket. Rank 0 hears of it, the sync fails on every
    rank (no version advance, the engine is excluded and holds partial weights paused), the other ranks finish
    their gathers without hanging, and the next sync brings the engine to the trainer's weights."""
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout(pp=2))
    engine = start_engine(models["qwen2"], in_process=True)
    try:
        r0, r1 = run_distributed(_lead_failure_body, world_size=2, parallel=ParallelConfig(pp=2), mcore_dir=mcore,
                                 url=engine.url, disk_dir=str(tmp_path / "disk"))
    finally:
        engine.stop()
    failed = r0["failed"]
    assert failed.policy_version is None and failed.updated == [] and failed.excluded == [engine.url]
    assert r1["failed"].policy_version is None  # every rank agrees
    resync = r0["resync"]
    assert resync.policy_version == 2 and resync.updated == [engine.url] and resync.excluded == []
    (lps, version), trainer = r0["after"]
    assert version == "2" and max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5


# ------------------------------------------------------------------------------------------------ bad config
@pytest.mark.parametrize("kwargs,message", [
    (dict(engine_urls=[]), "engine_urls must be a non-empty list"),
    (dict(engine_urls=["http://a", "http://a"]), "engine_urls has duplicates"),
    (dict(transport="nfs"), "transport must be one of"),
    (dict(transport="disk"), "transport='disk' needs disk_dir"),
    (dict(bucket_bytes=0), "bucket_bytes must be >= 1"),
    (dict(pause_mode="stop"), "pause_mode must be one of"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(backend="mpi"), "backend must be 'nccl' or 'gloo'"),
])
def test_config_errors(kwargs, message):
    base = dict(engine_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match=message):
        WeightSyncConfig(**{**base, **kwargs})


# An engine-side peer built the way SGLang's ``init_custom_process_group`` builds it (rendezvous over tcp://, the
# store wrapped in PrefixStore(group_name), then torch's group constructor), written out here on its own so that a
# change on the trainer's side that SGLang would not match fails this test instead of hanging a real sync.
_SGLANG_STYLE_PEER = """
import datetime, inspect, os, sys
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
port, name = int(sys.argv[1]), sys.argv[2]
timeout = datetime.timedelta(seconds=30)
store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
store = PrefixStore(name, store)
opt = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
made = _new_process_group_helper(2, 1, [], Backend("gloo"), store, group_name=name, timeout=timeout, **{opt: None})
group = made[0] if isinstance(made, tuple) else made
t = torch.zeros(3)
opts = dist.BroadcastOptions()
opts.rootRank = 0
group.broadcast([t], opts).wait()
print(t.tolist(), flush=True)
# An engine keeps its groups for its lifetime; skip the interpreter teardown, where gloo's destructor can race the
# trainer's end of the pair and abort ("terminate called without an active exception", seen under load).
os._exit(0)
"""


def test_trainer_group_meets_an_sglang_built_engine_group():
    import subprocess
    import sys
    import uuid

    from forge_megatron.weight_sync.transport import make_group

    port, name = free_port("127.0.0.1"), f"forge_weights_test_{uuid.uuid4().hex[:6]}"
    peer = subprocess.Popen([sys.executable, "-c", _SGLANG_STYLE_PEER, str(port), name], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        store, group = make_group("127.0.0.1", port, 2, name, "gloo", timeout_s=30)
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([torch.tensor([1.0, 2.0, 3.0])], opts).wait()
        out, err = peer.communicate(timeout=60)
    finally:
        peer.kill()
    assert peer.returncode == 0, err[-2000:]
    assert out.strip() == "[1.0, 2.0, 3.0]"


def test_group_names_are_unique_per_trainer_run():
    from forge_megatron.weight_sync.transport import DistributedTransport

    a, b = DistributedTransport(WeightSyncConfig(engine_urls=["http://x"]), None), \
        DistributedTransport(WeightSyncConfig(engine_urls=["http://x"]), None)
    assert a.group_name(0) != b.group_name(0) and a.group_name(0).startswith("forge_weights_")
    assert a.group_name(0) != a.group_name(1)  # one group per pipeline stage
    before = a.group_name(0)
    a.begin(["http://x"], 1)
    assert a.group_name(0) != before  # each generation of groups gets new names


def test_stage_leads_advertise_an_address_they_can_listen_on():
    from forge_megatron.weight_sync.transport import advertised_addr

    assert advertised_addr("127.0.0.1", "http://10.1.2.3:30000") == "127.0.0.1"
    # An address of another machine (TEST-NET-1): use the interface that reaches the engines instead.
    assert advertised_addr("192.0.2.1", "http://127.0.0.1:30000") == "127.0.0.1"


def _hf_load_body(rank, world_size, hf_dir, mcore_dir):
    """load_hf_weights at EP=2 vs the converter's shard of the same rank; and which HF tensors it read."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.convert import checkpoint as conv
    from forge_megatron.mcore.model import build_gpt
    from forge_megatron.training.checkpoint import load_hf_weights

    bridge = Bridge(hf_dir)
    model = build_gpt(bridge.cfg)
    read = []
    original = conv.HFReader.get

    def spy(self, names):
        read.extend(names)
        return original(self, names)

    conv.HFReader.get = spy
    try:
        load_hf_weights(model, bridge, hf_dir)
    finally:
        conv.HFReader.get = original
    want = conv.load_rank_state(mcore_dir, 0, 0, rank)
    got = model.state_dict()
    diff = max((got[k] - v).abs().max().item() for k, v in want.items() if torch.is_tensor(v))
    return diff, sorted(n for n in read if ".experts." in n)


def test_hf_weights_load_at_ep2_reads_only_own_experts(models, tmp_path):
    """Each EP rank loads exactly its shard (as forge-convert writes it) and reads none of the other rank's experts."""
    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen3_moe"], mcore, ParallelLayout(1, 1, 2))
    results = run_distributed(_hf_load_body, world_size=2, parallel=ParallelConfig(ep=2), hf_dir=models["qwen3_moe"],
                              mcore_dir=mcore)
    (diff0, experts0), (diff1, experts1) = results
    assert diff0 == 0.0 and diff1 == 0.0
    assert experts0 and experts1 and not set(experts0) & set(experts1)
