#!/usr/bin/env bash
# Agent RL on one machine: rollout engine(s), gateway + data pool, the rollout driver with your agent, and the trainer
# (torchrun, NPROC ranks). Every process is stopped on exit (success, error or Ctrl-C).
#
#   HF_CHECKPOINT=/models/Qwen3-8B MODEL=qwen3-8B TASKS=tasks.jsonl NPROC=4 TP=2 ENGINE=sglang bash scripts/run_local.sh
#   bash scripts/run_local.sh --dry-run      # print the commands only
#
# Settings (environment): HF_CHECKPOINT (required), MODEL (scripts/models/<MODEL>.sh, optional: the HF config is the
# architecture), TASKS (tasks JSONL), ENGINE (forge = CPU reference engine | sglang), NUM_ENGINES, NPROC, TP, PP, EP, ETP,
# CP, AGENT_CMD or AGENT_URL, GROUP_SIZE, GROUPS_PER_STEP, TRAIN_ITERS, LR, RUN_DIR, DOMAIN_RATIOS, EXTRA_TRAIN_ARGS,
# DRIVER_ARGS (more rollout-driver flags: --verifier, an LLM judge's --judge-*, a process reward model's
# --call-rm-*), CALL_RM_WEIGHT (with RM_CHECKPOINT: it also rewards single calls), RM_CHECKPOINT (a reward model served
# beside the engines, forge-engine on CPU or SGLang --is-embedding on the next GPU, scoring episodes: --verifier
# [RM_DOMAIN=]rm), JUDGE_CHECKPOINT (an LLM judge served the same way: --verifier [JUDGE_DOMAIN=]judge),
# POOL_ARGS (window and reward settings, e.g. "--window-fraction 0.5 --advantage-estimator rloo": applied by the data
# pool, given to the trainer too, which checks them against the pool), POLICY_SAMPLING (default 1: training calls are
# sampled at ROLLOUT_TEMPERATURE, default 1, whatever temperature the agent asks; 0: as the agent asks; the trainer
# scores tokens at ROLLOUT_TEMPERATURE either way), MALFORMED_CALL_REWARD (e.g. -0.1: malformed tool calls penalised on
# the call that made them, forge-node --malformed-call-reward), EVAL_TASKS (held-out tasks JSONL,
# evaluated every EVAL_EVERY policy versions into RUN_DIR/evals.jsonl), EPISODE_TIMEOUT_S (driver-side episode limit,
# default 1800; the pool times out what is idle for twice that, e.g. after a driver crash), TOOL_PARSER and
# REASONING_PARSER (the model's tool-call and thinking formats: the gateway's --tool-parser / --reasoning-parser;
# defaults from scripts/models/<MODEL>.sh when MODEL is set, else hermes and none), CHAT_TEMPLATE_KWARGS (JSON),
# TRUST_REMOTE_CODE (1: SGLang and the gateway run the tokenizer/config code the checkpoint ships, e.g. Kimi-K2),
# GATEWAY_WORKERS (N > 1: sessions served by N gateway processes behind the gateway port), LORA_RANK (R: train LoRA
# adapters, --lora-rank; more LoRA flags in EXTRA_TRAIN_ARGS) and LORA_SYNC (merged, the default, or adapter: the engines
# serve LoRA and load each version's adapter from RUN_DIR/adapters, as forge.sbatch's), TEACHER_CHECKPOINT (on-policy
# distillation: the trainer's --teacher-hf-checkpoint; with TEACHER_SERVED=1 served beside the engines as the
# scorers are, the gateway scoring each episode with it: --teacher-urls / --teacher-from-gateway;
# DISTILL_OUTCOME_COEF: 0 learns from the teacher alone; DISTILL_KL: sampled, the default, or forward / reverse /
# jsd, the dense divergence over the teacher's DISTILL_TOPK (default 32) most likely tokens, --distill-kl /
# --distill-topk, recorded by the gateway with a served teacher, --teacher-topk), CRITIC (1: PPO with a learned critic
# trained beside the policy, GAE advantages, --critic; CRITIC_CHECKPOINT: its initial weights, default HF_CHECKPOINT;
# CRITIC_LR, CRITIC_WARMUP_ITERS, GAE_LAMBDA, VALUE_CLIP: --critic-lr, --critic-warmup-iters, --gae-lambda,
# --value-clip), PPO_MINI_BATCHES / PPO_EPOCHS (optimizer steps per batch, --ppo-mini-batches / --ppo-epochs;
# PPO_TARGET_KL: --ppo-target-kl), LONGROPE_FACTORS (long / short: a longrope checkpoint's one factor list for the
# engines, SGLang pinned by --json-model-override-args, and the trainer). A Gemma 3 vision-language
# checkpoint starts SGLang with --attention-backend triton (SGLANG_ATTENTION_BACKEND overrides it), as forge.sbatch.
set -euo pipefail
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
[ "$DRY_RUN" = 1 ] || [ $# -eq 0 ] || { echo "run_local.sh: unknown argument $1 (only --dry-run)" >&2; exit 2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HF_CHECKPOINT="${HF_CHECKPOINT:?set HF_CHECKPOINT to a HF model directory}"
MODEL="${MODEL:-}"
MODEL_ARGS=()
# shellcheck disable=SC1090
[ -n "$MODEL" ] && source "$ROOT/scripts/models/$MODEL.sh"  # MODEL_ARGS, the model's TOOL_PARSER / REASONING_PARSER
TOOL_PARSER="${TOOL_PARSER:-hermes}"; REASONING_PARSER="${REASONING_PARSER:-}"; CHAT_TEMPLATE_KWARGS="${CHAT_TEMPLATE_KWARGS:-}"
TASKS="${TASKS:?set TASKS to a tasks JSONL file}"
ENGINE="${ENGINE:-forge}"
NUM_ENGINES="${NUM_ENGINES:-1}"
NPROC="${NPROC:-1}"; TP="${TP:-1}"; PP="${PP:-1}"; EP="${EP:-1}"; CP="${CP:-1}"; ETP="${ETP:-}"
AGENT_CMD="${AGENT_CMD:-}"; AGENT_URL="${AGENT_URL:-}"
GROUP_SIZE="${GROUP_SIZE:-8}"; GROUPS_PER_STEP="${GROUPS_PER_STEP:-4}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-1e-6}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/local}"
EXTRA_TRAIN_ARGS="${EXTRA_TRAIN_ARGS:-}"
POOL_ARGS="${POOL_ARGS:-}"
DRIVER_ARGS="${DRIVER_ARGS:-}"  # more rollout-driver flags, e.g. "--verifier judge --judge-url http://127.0.0.1:30010/v1"
DOMAIN_RATIOS="${DOMAIN_RATIOS:-}"
RM_CHECKPOINT="${RM_CHECKPOINT:-}"; RM_DOMAIN="${RM_DOMAIN:-}"; RM_PORT="${RM_PORT:-30100}"
CALL_RM_WEIGHT="${CALL_RM_WEIGHT:-}"  # with RM_CHECKPOINT: rewards of single calls from it too (empty: off)
if [ -n "$CALL_RM_WEIGHT" ] && [ -z "$RM_CHECKPOINT" ]; then
  echo "run_local.sh: CALL_RM_WEIGHT needs RM_CHECKPOINT (the reward model that scores the calls)" >&2; exit 2
fi
JUDGE_CHECKPOINT="${JUDGE_CHECKPOINT:-}"; JUDGE_DOMAIN="${JUDGE_DOMAIN:-}"; JUDGE_PORT="${JUDGE_PORT:-30200}"
TEACHER_CHECKPOINT="${TEACHER_CHECKPOINT:-}"; TEACHER_SERVED="${TEACHER_SERVED:-0}"; TEACHER_PORT="${TEACHER_PORT:-30300}"
DISTILL_OUTCOME_COEF="${DISTILL_OUTCOME_COEF:-1}"; DISTILL_KL="${DISTILL_KL:-sampled}"; DISTILL_TOPK="${DISTILL_TOPK:-32}"
CRITIC="${CRITIC:-0}"; CRITIC_CHECKPOINT="${CRITIC_CHECKPOINT:-}"; CRITIC_LR="${CRITIC_LR:-}"
CRITIC_WARMUP_ITERS="${CRITIC_WARMUP_ITERS:-0}"; GAE_LAMBDA="${GAE_LAMBDA:-1}"; VALUE_CLIP="${VALUE_CLIP:-}"
PPO_MINI_BATCHES="${PPO_MINI_BATCHES:-1}"; PPO_EPOCHS="${PPO_EPOCHS:-1}"; PPO_TARGET_KL="${PPO_TARGET_KL:-}"
POLICY_SAMPLING="${POLICY_SAMPLING:-1}"; ROLLOUT_TEMPERATURE="${ROLLOUT_TEMPERATURE:-1}"; EVAL_TASKS="${EVAL_TASKS:-}"; EVAL_EVERY="${EVAL_EVERY:-10}"
EPISODE_TIMEOUT_S="${EPISODE_TIMEOUT_S:-1800}"
LORA_RANK="${LORA_RANK:-}"; LORA_SYNC="${LORA_SYNC:-merged}"
ENGINE_PORT="${ENGINE_PORT:-30000}"; GATEWAY_PORT="${GATEWAY_PORT:-8000}"; POOL_PORT="${POOL_PORT:-5555}"

if [ -n "$AGENT_CMD" ]; then AGENT=(--agent-command "$AGENT_CMD")
elif [ -n "$AGENT_URL" ]; then AGENT=(--agent-url "$AGENT_URL")
else echo "run_local.sh: set AGENT_CMD (a program) or AGENT_URL (an HTTP agent service)" >&2; exit 2; fi
case "$LORA_SYNC" in merged) ;; adapter) [ -n "$LORA_RANK" ] || { echo "run_local.sh: LORA_SYNC=adapter needs LORA_RANK" >&2; exit 2; } ;;
  *) echo "run_local.sh: LORA_SYNC=$LORA_SYNC: merged or adapter" >&2; exit 2 ;; esac
(( NPROC % (TP * PP * CP) == 0 )) || { echo "run_local.sh: TP*PP*CP=$((TP * PP * CP)) must divide NPROC=$NPROC" >&2; exit 1; }
if [ -n "$RM_CHECKPOINT" ] && [ -n "$JUDGE_CHECKPOINT" ] && [ "$RM_DOMAIN" = "$JUDGE_DOMAIN" ]; then
  echo "run_local.sh: RM_CHECKPOINT and JUDGE_CHECKPOINT would both score ${RM_DOMAIN:-every domain}: give RM_DOMAIN or JUDGE_DOMAIN" >&2
  exit 2
fi

PIDS=()
show() { printf '+'; printf ' %q' "$@"; }
run_bg() {
  local name="$1"; shift
  show "$@"; echo " &> $RUN_DIR/logs/$name.log &"
  [ "$DRY_RUN" = 1 ] && return 0
  setsid "$@" &> "$RUN_DIR/logs/$name.log" &
  PIDS+=($!)
}
wait_http() {
  echo "+ wait_http $1"
  [ "$DRY_RUN" = 1 ] && return 0
  for _ in $(seq 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done
  echo "run_local.sh: $1 did not come up (see $RUN_DIR/logs)" >&2; exit 1
}
teardown() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  exit "$rc"
}
[ "$DRY_RUN" = 1 ] || { mkdir -p "$RUN_DIR/logs"; trap teardown EXIT INT TERM; }

SGLANG_FLAGS=(); FORGE_ENGINE_FLAGS=()
[ "${TRUST_REMOTE_CODE:-0}" = 1 ] && SGLANG_FLAGS+=(--trust-remote-code)
# Gemma 3's images attend to themselves bidirectionally: in SGLang only the Triton attention backend does that
if grep -qs '"Gemma3ForConditionalGeneration"' "$HF_CHECKPOINT/config.json" || [ -n "${SGLANG_ATTENTION_BACKEND:-}" ]; then
  SGLANG_FLAGS+=(--attention-backend "${SGLANG_ATTENTION_BACKEND:-triton}")
fi
if [ "$LORA_SYNC" = adapter ]; then
  SGLANG_FLAGS+=(--enable-lora --max-lora-rank "$LORA_RANK" --lora-target-modules all); FORGE_ENGINE_FLAGS+=(--enable-lora)
fi
# longrope (Phi-3.5, Phi-4-mini): every engine and the trainer rotate with one factor list (LONGROPE_FACTORS: long or
# short; default the trainer's, long when the context exceeds the original one); SGLang would switch lists per batch
LONGROPE_FACTORS="${LONGROPE_FACTORS:-}"
if grep -Eqs '"(longrope|su)"' "$HF_CHECKPOINT/config.json"; then
  SGLANG_FLAGS+=(--json-model-override-args "$(python -m forge_megatron.convert.cli longrope-override \
                 --hf-dir "$HF_CHECKPOINT" ${LONGROPE_FACTORS:+--factors "$LONGROPE_FACTORS"})")
  [ -n "$LONGROPE_FACTORS" ] && FORGE_ENGINE_FLAGS+=(--longrope-factors "$LONGROPE_FACTORS")
fi
# MiniMax-M1 as released (MiniMaxM1ForCausalLM): SGLang registers the model as MiniMaxText01ForCausalLM only (the
# same layers and weight names): served under that name, as forge.sbatch does
if grep -Eqs '"MiniMaxM1ForCausalLM"' "$HF_CHECKPOINT/config.json"; then
  SGLANG_FLAGS+=(--json-model-override-args '{"architectures": ["MiniMaxText01ForCausalLM"]}')
fi
# a trained vision tower: no image embedding of an old tower from SGLang's cache after a sync (as forge.sbatch)
SGLANG_ENV=()
if [[ " $EXTRA_TRAIN_ARGS " == *" --train-vision-tower "* ]]; then
  SGLANG_ENV+=("SGLANG_VLM_CACHE_SIZE_MB=${SGLANG_VLM_CACHE_SIZE_MB:-0}")
fi
# images as token ids, one placeholder each, written out by SGLang in token space (as forge.sbatch; not Mistral 3)
if grep -qs '"vision_config"' "$HF_CHECKPOINT/config.json" && \
    ! grep -qs '"Mistral3ForConditionalGeneration"' "$HF_CHECKPOINT/config.json"; then
  SGLANG_ENV+=("SGLANG_MM_AVOID_RETOKENIZE=${SGLANG_MM_AVOID_RETOKENIZE:-1}")
fi
ENGINE_URLS=()
for ((e = 0; e < NUM_ENGINES; e++)); do
  port=$((ENGINE_PORT + e))
  if [ "$ENGINE" = sglang ]; then
    run_bg "engine-$e" env CUDA_VISIBLE_DEVICES="$((NPROC + e))" ${SGLANG_ENV[@]+"${SGLANG_ENV[@]}"} \
      python -m sglang.launch_server \
      --model-path "$HF_CHECKPOINT" --host 127.0.0.1 --port "$port" ${SGLANG_FLAGS[@]+"${SGLANG_FLAGS[@]}"}
  else
    run_bg "engine-$e" python -m forge_megatron.rollout.engine_server --model-path "$HF_CHECKPOINT" \
      --host 127.0.0.1 --port "$port" ${FORGE_ENGINE_FLAGS[@]+"${FORGE_ENGINE_FLAGS[@]}"}
  fi
  ENGINE_URLS+=("http://127.0.0.1:$port")
done
for url in "${ENGINE_URLS[@]}"; do wait_http "$url/health"; done
# a reward model and an LLM judge for the driver's verifiers, on the GPUs after the engines' (SGLang) or on CPU
# shellcheck disable=SC2206
DRIVER_FLAGS=($DRIVER_ARGS)
next_gpu=$((NPROC + NUM_ENGINES))
serve_scorer() {  # serve_scorer <log name> <checkpoint> <port> <SGLang flags...>
  local name="$1" ckpt="$2" port="$3"; shift 3
  if [ "$ENGINE" = sglang ]; then
    run_bg "$name" env CUDA_VISIBLE_DEVICES="$next_gpu" python -m sglang.launch_server --model-path "$ckpt" \
      --host 127.0.0.1 --port "$port" "$@"
    next_gpu=$((next_gpu + 1))
  else
    run_bg "$name" python -m forge_megatron.rollout.engine_server --model-path "$ckpt" --host 127.0.0.1 --port "$port"
  fi
  wait_http "http://127.0.0.1:$port/health"
}
if [ -n "$RM_CHECKPOINT" ]; then
  serve_scorer reward-model "$RM_CHECKPOINT" "$RM_PORT" --is-embedding
  DRIVER_FLAGS+=(--verifier "${RM_DOMAIN:+$RM_DOMAIN=}rm" --rm-url "http://127.0.0.1:$RM_PORT" --rm-tokenizer "$RM_CHECKPOINT")
  [ -n "$CALL_RM_WEIGHT" ] && DRIVER_FLAGS+=(--call-rm-url "http://127.0.0.1:$RM_PORT" --call-rm-tokenizer "$RM_CHECKPOINT"
                                             --call-rm-weight "$CALL_RM_WEIGHT")
fi
if [ -n "$JUDGE_CHECKPOINT" ]; then
  serve_scorer judge "$JUDGE_CHECKPOINT" "$JUDGE_PORT" --served-model-name judge
  DRIVER_FLAGS+=(--verifier "${JUDGE_DOMAIN:+$JUDGE_DOMAIN=}judge" --judge-url "http://127.0.0.1:$JUDGE_PORT/v1"
                 --judge-model judge)
fi
TEACHER_NODE_FLAGS=(); TEACHER_TRAIN_FLAGS=()  # on-policy distillation (docs/training.md)
case "$DISTILL_KL" in
  sampled) DISTILL_FLAGS=(--distill-kl sampled) ;;
  forward|reverse|jsd) DISTILL_FLAGS=(--distill-kl "$DISTILL_KL" --distill-topk "$DISTILL_TOPK") ;;
  *) echo "run_local.sh: DISTILL_KL=$DISTILL_KL: sampled, forward, reverse or jsd" >&2; exit 2 ;;
esac
if [ -n "$TEACHER_CHECKPOINT" ] && [ "$TEACHER_SERVED" = 1 ]; then  # the gateway scores episodes with it
  serve_scorer teacher "$TEACHER_CHECKPOINT" "$TEACHER_PORT"
  TEACHER_NODE_FLAGS+=(--teacher-urls "http://127.0.0.1:$TEACHER_PORT")
  if [ "$DISTILL_KL" != sampled ]; then TEACHER_NODE_FLAGS+=(--teacher-topk "$DISTILL_TOPK"); fi
  TEACHER_TRAIN_FLAGS+=(--teacher-from-gateway --distill-outcome-coef "$DISTILL_OUTCOME_COEF" "${DISTILL_FLAGS[@]}")
elif [ -n "$TEACHER_CHECKPOINT" ]; then  # in the trainer, split like the policy
  TEACHER_TRAIN_FLAGS+=(--teacher-hf-checkpoint "$TEACHER_CHECKPOINT" --distill-outcome-coef "$DISTILL_OUTCOME_COEF"
                        "${DISTILL_FLAGS[@]}")
elif [ "$TEACHER_SERVED" = 1 ] || [ "$DISTILL_OUTCOME_COEF" != 1 ] || [ "$DISTILL_KL" != sampled ]; then
  echo "run_local.sh: TEACHER_SERVED / DISTILL_OUTCOME_COEF / DISTILL_KL need TEACHER_CHECKPOINT (the teacher)" >&2; exit 2
fi
ENGINES_CSV="$(IFS=,; echo "${ENGINE_URLS[*]}")"
GATEWAY_URL="http://127.0.0.1:$GATEWAY_PORT"
POOL_ADDR="tcp://127.0.0.1:$POOL_PORT"

# shellcheck disable=SC2206
POOLX=($POOL_ARGS)
NODE_FLAGS=()  # gateway flags: the trainer, which gets POOL_ARGS too, never sees them
[ "$POLICY_SAMPLING" = 1 ] && NODE_FLAGS+=(--policy-sampling)
NODE_FLAGS+=(--policy-temperature "$ROLLOUT_TEMPERATURE" --tool-parser "$TOOL_PARSER")
[ -n "$REASONING_PARSER" ] && NODE_FLAGS+=(--reasoning-parser "$REASONING_PARSER")
[ -n "$CHAT_TEMPLATE_KWARGS" ] && NODE_FLAGS+=(--chat-template-kwargs "$CHAT_TEMPLATE_KWARGS")
[ -n "${MALFORMED_CALL_REWARD:-}" ] && NODE_FLAGS+=(--malformed-call-reward "$MALFORMED_CALL_REWARD")
[ "${TRUST_REMOTE_CODE:-0}" = 1 ] && NODE_FLAGS+=(--trust-remote-code)
[ "${GATEWAY_WORKERS:-1}" -gt 1 ] && NODE_FLAGS+=(--gateway-workers "$GATEWAY_WORKERS")
NODE_FLAGS+=(${TEACHER_NODE_FLAGS[@]+"${TEACHER_NODE_FLAGS[@]}"})
[ -n "$EVAL_TASKS" ] && DRIVER_FLAGS+=(--eval-tasks "$EVAL_TASKS" --eval-every-versions "$EVAL_EVERY"
                                       --eval-output "$RUN_DIR/evals.jsonl")
run_bg middleware python -m forge_megatron.agents.middleware_node --model-path "$HF_CHECKPOINT" \
  --engines "$ENGINES_CSV" --port "$GATEWAY_PORT" --pool-bind "$POOL_ADDR" --pool-db "$RUN_DIR/pool.sqlite" \
  --rollout-batch-groups "$GROUPS_PER_STEP" --train-batch-groups "$GROUPS_PER_STEP" --max-staleness 2 "${POOLX[@]}" \
  --episode-timeout-s "$((EPISODE_TIMEOUT_S * 2))" --session-idle-timeout-s "$((EPISODE_TIMEOUT_S * 2))" \
  ${NODE_FLAGS[@]+"${NODE_FLAGS[@]}"}
wait_http "$GATEWAY_URL/v1/models"
run_bg driver python -m forge_megatron.agents.driver --gateway-url "$GATEWAY_URL" --tasks "$TASKS" \
  --group-size "$GROUP_SIZE" --max-inflight-groups "$GROUPS_PER_STEP" --pool-addr "$POOL_ADDR" "${AGENT[@]}" \
  --episode-timeout-s "$EPISODE_TIMEOUT_S" \
  ${DOMAIN_RATIOS:+--domain-ratios "$DOMAIN_RATIOS"} ${DRIVER_FLAGS[@]+"${DRIVER_FLAGS[@]}"}

# shellcheck disable=SC2206
EXTRA=($EXTRA_TRAIN_ARGS)
[ "$TP" -gt 1 ] && EXTRA+=(--sequence-parallel)  # with TP (Megatron's MoE layer needs it under TP)
EXTRA+=(--rollout-temperature "$ROLLOUT_TEMPERATURE")  # the temperature the engines sample (and score) at
[ -n "$LORA_RANK" ] && EXTRA+=(--lora-rank "$LORA_RANK")
[ -n "$LONGROPE_FACTORS" ] && EXTRA+=(--longrope-factors "$LONGROPE_FACTORS")
EXTRA+=(${TEACHER_TRAIN_FLAGS[@]+"${TEACHER_TRAIN_FLAGS[@]}"})
if [ "$CRITIC" = 1 ] || [ -n "$CRITIC_CHECKPOINT" ]; then  # PPO with a learned critic (docs/training.md)
  EXTRA+=(--critic ${CRITIC_CHECKPOINT:+--critic-hf-checkpoint "$CRITIC_CHECKPOINT"} ${CRITIC_LR:+--critic-lr "$CRITIC_LR"}
          --critic-warmup-iters "$CRITIC_WARMUP_ITERS" --gae-lambda "$GAE_LAMBDA" ${VALUE_CLIP:+--value-clip "$VALUE_CLIP"})
elif [ -n "$CRITIC_LR" ] || [ "$CRITIC_WARMUP_ITERS" != 0 ] || [ "$GAE_LAMBDA" != 1 ] || [ -n "$VALUE_CLIP" ]; then
  echo "run_local.sh: CRITIC_LR / CRITIC_WARMUP_ITERS / GAE_LAMBDA / VALUE_CLIP need CRITIC=1 (a learned critic)" >&2; exit 2
fi
EXTRA+=(--ppo-mini-batches "$PPO_MINI_BATCHES" --ppo-epochs "$PPO_EPOCHS")  # optimizer steps per batch
[ -n "$PPO_TARGET_KL" ] && EXTRA+=(--ppo-target-kl "$PPO_TARGET_KL")
[ "$LORA_SYNC" = adapter ] && EXTRA+=(--weight-sync-lora adapter --weight-sync-dir "$RUN_DIR/adapters")
TRAIN_CMD=(torchrun --nproc-per-node "$NPROC" "$ROOT/scripts/train_forge.py" "${MODEL_ARGS[@]}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --expert-model-parallel-size "$EP" ${ETP:+--expert-tensor-parallel-size "$ETP"} --context-parallel-size "$CP"
  --hf-checkpoint "$HF_CHECKPOINT" --lr "$LR" --train-iters "$TRAIN_ITERS"
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 20
  --metrics-jsonl "$RUN_DIR/metrics.jsonl" --pool-addr "$POOL_ADDR" --gateway-url "$GATEWAY_URL"
  --engine-urls "$ENGINES_CSV" --weight-sync-transport distributed --train-batch-groups "$GROUPS_PER_STEP"
  --rollout-batch-groups "$GROUPS_PER_STEP" --group-size "$GROUP_SIZE" ${DOMAIN_RATIOS:+--domain-ratios "$DOMAIN_RATIOS"}
  "${POOLX[@]}" "${EXTRA[@]}")
show "${TRAIN_CMD[@]}"; echo
[ "$DRY_RUN" = 1 ] && exit 0
"${TRAIN_CMD[@]}"
