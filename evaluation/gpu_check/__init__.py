"""The one-call GPU acceptance: ``python -m evaluation.gpu_check`` (about 10 minutes on one GPU).

    python -m evaluation.gpu_check [--out docs/results/gpu_check] [--stages NAME ...] [--dry-run]

Every stage runs in its own subprocess under its own timeout and the JSON report
(``<out>/gpu_check.json``) is rewritten after each one, most telling first, so a hang or crash in
one stage still leaves the earlier results and the later stages run:

1. ``environment``: versions, ``pip check``, driver, ``torch.cuda.is_available()``, imported triton.
2. ``trainer_247m``: the real trainer at the 247M production shape (seq 1024, micro-batch 8, bf16,
   ZeRO-1, synthetic tokens), 12 steps, save at 10, resume: tokens/s, MFU, peak memory, skipped
   steps, a profile of steps 6-8 (GEMMs vs attention kernels vs feature maps; device-to-host copies).
3. ``softmax_247m``: softmax attention at the same shape, for the throughput ratio.
4. ``kernel_sweep``: bf16 forward + backward vs SDPA-flash and fla, the int32-boundary probe, the
   AOT report's registers/spills/shared memory (``stages_kernels.py``).
5. ``precision_41m``: bf16 vs fp32 (and bf16 with fp32 accumulation) on the 41M Flexformer-N for
   100 steps: final-loss gaps and tau trajectories.
6. ``kernel_accuracy``: the compiled kernels against the fp64 quadratic form.
7. ``window_kernels``: the window hybrid's Triton form against its torch Function in fp64 (fp32,
   bf16, fp16) and both timed at the 247M / 1.3B shapes (``stages_window.py``).

``--dry-run`` runs every stage at tiny shapes on CPU (kernels under Triton's interpreter) in seconds
to a minute each; tests/test_eval_gpu_check.py does so.
"""
