"""The one-call GPU acceptance: ``python -m benchmarks.gpu_check`` (at most 9 minutes on one GPU).

    python -m benchmarks.gpu_check [--out DIR] [--deadline 540] [--stages NAME ...] [--dry-run]

Every stage runs in its own subprocess (its own process group: a timeout, Ctrl-C or SIGTERM kills
it and the trainers it started) under one global deadline (``--deadline``, default 540 s). Stages
run most valuable first; one that needs more than the time left (its estimate for a cold Triton
cache) is skipped with the reason recorded, the running one is cut at the deadline. The JSON report
(``<out>/gpu_check.json``; default ``$XDG_CACHE_HOME/megaflex/gpu_check/<time>``, outside the
repository) is rewritten after each stage, and stages write their rows as each case finishes, so a
stage that is killed keeps what it measured. Every stage and trainer compiles into one Triton
cache (``TRITON_CACHE_DIR``: ``--triton-cache``, else the set one, else the trainer's node-local
one for local rank 0). Exit status 1 when anything failed, including failures a stage caught
itself (an ``error`` or ``passed: False`` at any depth, printed on the console), 3 when nothing
failed but a stage was skipped or cut for the deadline (*not run (time)*); see ``__main__``. On a
lent machine, ``benchmarks/gpu_check/on_device.sh WHEELS OUT`` does the whole call.

1. ``environment``: versions, ``pip check``, driver, ``torch.cuda.is_available()``, imported triton.
2. ``trainer_247m``: the real trainer at the 247M production shape (seq 1024, micro-batch 8, bf16,
   ZeRO-1, synthetic tokens, no validation), 12 steps, save at 10, resume: tokens/s, MFU, peak
   memory, skipped steps, a profile of steps 6-8 (GEMMs vs attention kernels vs feature maps;
   device-to-host copies); a trainer's log tail on failure.
3. ``kernel_accuracy``: the compiled kernels against the fp64 quadratic form, the production path
   (fused trig, bf16) first, case sets compiled in parallel processes (``accuracy.py``).
4. ``softmax_247m``: softmax attention at the same shape, for the throughput ratio.
5. ``kernel_sweep``: bf16 forward + backward vs SDPA-flash and fla, the int32-boundary probe, the
   AOT report's registers/spills/shared memory (``stages_kernels.py``).
6. ``precision_41m``: fp32 (tf32 matmuls in torch and the kernels alike) vs bf16 (and bf16 with
   fp32 accumulation) on the 41M Flexformer-N for 100 steps, the three runs at once: final-loss
   gaps and tau trajectories; whether bf16 storage of Omega and tau matters (``bf16_storage.py``).
7. ``window_kernels``: the window hybrid's Triton form against its torch Function in fp64 (bf16,
   fp32, fp16) and both timed at the 247M / 1.3B shapes (``stages_window.py``).

``--dry-run`` runs every stage at tiny shapes on CPU (kernels under Triton's interpreter) in about
a minute and a half in all; tests/benchmarks/test_eval_gpu_check.py does so.
"""
