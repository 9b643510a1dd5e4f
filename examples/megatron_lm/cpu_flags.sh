# Sourced by the example scripts: a tiny BF16 GPT that Megatron-LM's pretrain_gpt.py trains on CPU
# ranks. --vocab-size 1023 (+1 EOD) pads to 1024 rows at every TP size up to 8, so runs at different
# TP sizes train the same model (512 would pad to 640 / 768 / 1024 at TP 1 / 2 / 4). On GPUs keep your
# own model flags and drop the CPU_ONLY ones.
MODEL=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64
  --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8
  --train-iters 10 --lr 3e-3 --min-lr 3e-3 --lr-decay-style constant --seed 1234
  --attention-dropout 0 --hidden-dropout 0 --bf16
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1023
  --log-interval 1 --eval-iters 0 --eval-interval 1000
)
# what a machine without CUDA kernels needs (megatron-core's local layers, gloo, no fused kernels)
CPU_ONLY=(
  --distributed-backend gloo --use-cpu-initialization --transformer-impl local
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
  --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
)
# Megatron-LM requires this for TP > 1 before Blackwell; the CPU launcher reports no CUDA architecture
export CUDA_DEVICE_MAX_CONNECTIONS=1
cd "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to your Megatron-LM checkout (the directory with pretrain_gpt.py)}"
