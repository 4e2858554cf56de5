#!/usr/bin/env bash
# Stages 1-5 ran at commit 4467d86 (before interleaved timing: their --rounds flags are gone);
# stages 6-10 at the commits that recorded benchmarks/results/2xh200-2026-11-22-scatter-add/.
# The GPU run, in device calls (each under the tool's 10-minute limit):
#   stage 1: check the fused kernels (outputs and gradients against float32, plan errors) and
#            tune every preset (cache in $OUT/r/tune.json, fused tilings among the candidates);
#   stage 2: the checks stage 1 ran out of time for (XLA autotuning off: it only slows the
#            compiles of the check), and the AG presets tuned again over more tilings;
#   stage 3: the tilings' gradient checks again (stage 2 found the backward config kept the
#            fused tiling; fixed), then the suite (our methods incl. fused and AUTO, XLA dot, XLA
#            windowed einsum, PyTorch async TP) with AUTO reading the tune cache given as $2.
#   stage 4: the final figures: comm_heavy (both ops) and llama8b RS tuned again over more
#            tilings (epilogue blocks), then the suite with the variants timed in turn, 3 rounds.
#   stage 5: the suite again, 5 rounds in shuffled order, vs_bound per round (stage 4 and an
#            A/B of identical executables showed the GPUs' speed drifting during a run).
#   stage 6: (new session) the direct reduce-add kernel (ATOMIC_GEMM_RS, `fused-direct`): its
#            outputs against float32 on every shape, then each RS preset timed (interleaved
#            timing, device spans) beside the ring kernel; comm_heavy AG over more tilings.
#   stage 7: fused-direct with gradients; tune the three issue presets (interleaved timing;
#            fused-direct among the RS candidates).
#   stage 8: the new default tiling (bands 8 wide) with gradients; the suite with AUTO reading stage 7's cache; llama13b_mlp is left untuned (AUTO's
#            cost model alone); interleaved timing plus device spans.
#   stage 9: the suite again, device spans now the busy time of each call (stage 8's spans ran
#            first kernel to last and caught the host's launch gaps inside a fused call).
#   stage 10: back-to-back calls of each fused kernel against the same calls run alone.
#   stage 11: levers left unrecorded: the GEMM lead (XLA vs Mosaic vs torch cuBLAS on
#            llama70b's local GEMM, under default / cuBLAS / autotune-0 flags); XLA's latency-
#            hiding scheduler off; bidirectional and aggregated rings.
#   stage 12: the suite again with the stricter bound (t_gemm: the faster of XLA's two GEMM
#            forms, bf16 result or float32 result cast; stage 11 found them 5% apart), and the
#            GEMM forms on comm_heavy AG's local shape beside the Mosaic GEMM.
#   stage 13: fused-direct with its zeroing awaited at the first tile instead of before it:
#            outputs and back-to-back calls checked, then an A/B against the stage-12 version.
#   stage 14: (new session) where the fused kernels' time goes (benchmarks/probe.py): the
#            Mosaic GEMM alone (with and without 2-CTA clusters), fused-direct's epilogue
#            variants (own-store candidates and diagnostics) and clusters, back-to-back device
#            periods beside the interleaved timing. Ran at commit 5c3e0f1 (its own-store epilogues
#            and --epilogues / --clusters flags are gone).
#   stage 15: A/B by interleaved device periods: fused-direct's alternating block order,
#            whole-tile epilogue buffers (s3-b4) and 2-CTA clusters, against the stage-12 kernel.
#            Ran at commit b0b290f (the alternating order, "+alt", is gone since).
#   stage 16: the same for the lagged schedule (plain own stores, no zeroing) with clusters.
#            Ran at commit a87e7e7 ("+lag" is gone since).
#   stage 17: tune the three issue presets again, candidates ranked by device periods (2-CTA
#            cluster tilings of fused-direct among them). First ran at ee43e40 with --iters 10,
#            where periods failed and the host timing ranked; again at 325fa1d as below.
#   stage 18: the suite with device periods (interleaved rounds, GPU timestamps) as the
#            device-side figure, AUTO reading stage 17's cache; PyTorch timed 8 calls a sample.
#   stage 19: (new session) the direct all-gather kernel (ATOMIC_GEMM_AG, `fused-direct` on AG:
#            rows pushed to the peer, per-band flags) and the direct RS kernel with one wgmma in
#            flight (-d1) or its tiles chained in one pipeline (-ct): outputs against float32 on
#            every check shape and back-to-back calls, then a tune of each issue preset over the
#            fused specs (ranked by device periods) on top of stage 17's cache; llama13b_mlp tuned
#            into a separate cache (tune13b.json), so that the suite's AUTO stays untuned there.
#   stage 20: the direct all-gather kernel with each band pushed by its first 8 tiles (stage 19's
#            kernel, one sender a band, is now -p1): outputs and back-to-back calls, then the AG
#            presets tuned again over the fused specs on top of stage 19's cache (llama13b_mlp
#            into tune13b.json as before).
#   stage 21: the suite as in stage 18, AUTO reading stage 20's cache (the cost model now picks
#            the direct AG kernel along M where it is untuned: llama13b_mlp).
#   stage 22: stage 21's suite found the direct AG kernel in 2-CTA clusters (never tuned) the
#            fastest on comm_heavy AG, and llama70b RS's tuned pick (-d1) behind plain
#            fused-direct: those two tuned again over more specs, then the suite again.
#   stage 23: the ping-pong RS kernel (`fused-direct-pp-s3`: whole tiles per compute warpgroup,
#            one's epilogue under the other's K loop): outputs on every check shape and back-to-
#            back calls, the RS presets tuned over it and the best earlier specs (on top of stage
#            22's cache; llama13b_mlp into tune13b.json), then the suite again. Ran at commit
#            537cbb7 (the ping-pong kernel, 1.35x the bound, and its -pp spec are gone since).
#   stage 24: (new session) the direct RS kernel with its last, partly filled wave split along K
#            (`-t0`: split_tail chosen by the kernel's wave model) and warpgroup tiles of 64 x 256
#            (`-wgm-m64-n256`, as cuBLAS's cooperative kernels): outputs on check shapes and
#            back-to-back calls, then the RS presets tuned over them and the best earlier specs
#            (on top of stage 22's cache; llama13b_mlp into tune13b.json), and comm_heavy AG
#            over the 64 x 256 tiles.
#   stage 25: the suite again, AUTO reading stage 24's cache.
#   stage 26: the cost model's new RS tiling (64 x 256 warpgroup tiles in clusters, chained,
#            split tail) checked on the check shapes with back-to-back calls, then llama8b_mlp and
#            llama13b_mlp RS tuned over its band widths, grid order and one wgmma in flight, and
#            comm_heavy AG over band widths and senders (on top of stage 24's caches).
#   stage 27: the direct RS kernel with peer_store (`-ps`: the peer's copy of a tile stored
#            plainly two waves before the owner adds its own, per-tile flags, only the first
#            wave's tiles zeroed): outputs on the check shapes and back-to-back calls, then, if
#            they pass, the RS presets tuned over it beside the best earlier specs (on top of
#            stage 26's caches). Ran at commit 670ca57 (peer_store, 1.21 to 1.38x the bound, is
#            gone since).
#   stage 28: the suite again, AUTO reading stage 27's cache (at 670ca57).
#   stage 29: the same suite once more, at the commit that dropped peer_store.
#   stage 30: (new session) the direct AG kernel with its own tiles spread among the peers'
#            (`-r<N>`, FusedTiles.spread) and the ring RS kernel with one semaphore per step:
#            outputs on check shapes and back-to-back calls, then, if they pass, comm_heavy and
#            llama8b_mlp AG tuned over spreads (on top of stage 27's cache).
#   stage 31: the suite again, AUTO reading stage 30's cache.
#   stage 32: the direct RS kernel with the peers' copies of its tiles run ahead of the own
#            copies (`-l<N>`, FusedTiles.peer_lead): outputs on check shapes and back-to-back
#            calls, then, if they pass, llama8b_mlp and comm_heavy RS tuned over leads (on top
#            of stage 30's cache). Ran at commit c2031c8 (peer_lead, 1 to 7% slower, is gone
#            since).
#   stage 33: the suite again, AUTO reading stage 30's cache (at c2031c8).
#   stage 34: (new session) where the direct RS kernel's time goes: Mosaic GPU's profiler on
#            its compute warpgroups (benchmarks/kernel_profile.py: zeroing, K loops, epilogues,
#            the end's wait, in SM cycles) for AUTO's llama8b_mlp and comm_heavy RS kernel and
#            its bare loop; then the RS presets probed (benchmarks/probe.py, device periods):
#            the zeroing awaited at the first epilogue (@add-late-zero), epilogue blocks of 32,
#            K-steps of 128 in 2 stages, 3 stages, and the diagnostics (no zeroing, plain local
#            stores, local adds only, plain remote stores) beside jax's Mosaic GEMM. Ran at
#            commit eb8f0dc (add-late-zero, 1.5% slower, is gone since).
#   stage 35: the direct RS kernel with its zeroing staged (`-z<G>`, FusedTiles.zero_chunk:
#            chunks of G waves, each zeroed while the tiles two chunks before run): outputs on
#            llama8b_mlp's shape and back-to-back calls, then, if they pass, the RS presets
#            probed over G (device periods) beside the kernel without zeroing, and G = 2
#            profiled on llama8b_mlp. Ran at commit 5e69f45 (zero_chunk, 3 to 20% slower, is
#            gone since).
#   stage 36: K-steps of 128 in 2 stages (`-k128-s2`; stage 34: 0.5% faster on three RS
#            presets): outputs on llama8b_mlp's shape and back-to-back calls, then, if they
#            pass, the RS presets tuned over them beside the earlier picks (on top of stage 30's
#            cache; llama13b_mlp into tune13b.json).
#   stage 37: the suite again, AUTO reading stage 36's cache.
#   stage 38: the suite again, AUTO reading stage 30's cache (as stages 31 and 33).
#   stage 39: (new session) the direct RS kernel zeroing its output D waves ahead of the adds
#            (`-a<D>`, FusedTiles.zero_ahead: the first D waves' tiles zeroed first, the rest
#            by the load warpgroups while they load, one semaphore a wave): outputs on two
#            shapes, both w layouts, more tilings and back-to-back calls, then, if they pass,
#            the RS presets probed over D (device periods) beside the kernel without zeroing,
#            and D = 3 profiled on llama8b_mlp.
#   stage 40: where stage 39's zero_ahead loses (7% slower): its parts switched off in turn
#            (@add-ahead-nowait / -nosync / -nostore: the load warpgroups' semaphore waits, all
#            their handshakes, their zero stores; wrong sums) on llama8b_mlp and comm_heavy RS,
#            and the profile of 3-stage unchained kernels (the profiler's smem fits beside them)
#            with and without zero_ahead, the load warpgroups' phases named.
#   stage 41: zero_ahead with the waves' signals relaxed (no system-scope release fence; stage
#            40 found those fences the whole loss): outputs on llama8b_mlp's shape, both w
#            layouts, more tilings and back-to-back calls, then, if they pass, the RS presets
#            probed over D beside the release-fenced signals and the kernel without zeroing.
#   stage 42: zero_ahead's stores in bands of a tile's width (one tile lookup a band, not a
#            block): outputs checked as in stage 41, then, if they pass, llama8b_mlp and
#            comm_heavy RS tuned over D beside the earlier pick (on top of stage 30's cache),
#            and llama13b_mlp RS into a cache of its own (tune13b.json; the suite leaves
#            llama13b_mlp to the cost model).
#   stage 43: the suite again, AUTO reading stage 42's cache.
#   stage 44: the direct kernels' remaining release-fenced signals relaxed (RS: the start's
#            "zeroed" and the end's "landed"; AG: the bands' flags): outputs of AUTO's RS and
#            AG picks on llama8b_mlp's shape, both w layouts, more tilings and 24 back-to-back
#            calls, then, if they pass, those kernels probed against their fenced versions
#            (@add-fenced, @fenced) on the RS and AG presets.
#            Its "@add-fenced" rows stored plainly (wrong sums, the probe's flags were wrong;
#            `scatter_add_gemm.epilogue_flags` since): only its AG rows and checks count.
#   stage 45: the suite again, AUTO reading stage 42's cache.
#   stage 46: stage 44's RS probe again with "@add-fenced" fixed (zeroed and added, only the
#            start's and end's signals release-fenced), then the suite (as stage 45).
#   device run:  bash benchmarks/gpu_run.sh 1
#                bash benchmarks/gpu_run.sh 2 benchmarks/results/<run>/tune.json
#                bash benchmarks/gpu_run.sh 3 benchmarks/results/<run>/tune.json
#                bash benchmarks/gpu_run.sh 4 benchmarks/results/<run>/tune.json
#                bash benchmarks/gpu_run.sh 5 benchmarks/results/<run>/tune.json
# Everything lands in $OUT/results.tgz.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COLUMNS=200 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COMMGEMM_TUNE_CACHE=$OUT/r/tune.json
mkdir -p $OUT/r
# The suite of stages 8, 9 and 12: suite NAME OVERALL_TIMEOUT PER_MODE_TIMEOUT
suite() {
  timeout $2 python3 benchmarks/gpu_suite.py --out $OUT/r/$1 --iters 30 --spans 8 \
    --timeout $3 --modes default,windowed_einsum 2>&1 | tee $OUT/r/$1.log \
    | grep -E "^\[|^\||timed out"
}
# The device-periods suite of stages 18 to 46: periods_suite NAME OVERALL_TIMEOUT
periods_suite() {
  timeout $2 python3 benchmarks/gpu_suite.py --out $OUT/r/$1 --iters 15 --spans 0 \
    --periods 6 --timeout 380 --modes default,windowed_einsum 2>&1 | tee $OUT/r/$1.log \
    | grep -E "^\||timed out"
}
# Output check of RS tilings on llama8b_mlp's shape (both w layouts, 24 back-to-back calls of the
# base): rs_check NAME TIMEOUT BASE TILINGS; succeeds when every case passed and the last tiling ran.
rs_check() {
  timeout $2 python3 benchmarks/fused_check.py --out $OUT/r --name $1_rs --ops rs --shapes 3 \
    --base $3 --tilings $4 --no-grads --repeat 24 > $OUT/r/$1.log 2>&1
  grep 'fused check' $OUT/r/$1.log; grep -E '"ok": false|Error|rror:' $OUT/r/$1.log \
    | cut -c1-300 | head -8
  ! grep -q '"ok": false' $OUT/r/$1.log && grep -q "\"spec\": \"${4##*,}\"" $OUT/r/$1.log
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $OUT/r/gpus.txt
if [ "$1" = 1 ]; then
  timeout 200 python3 benchmarks/fused_check.py --out $OUT/r > $OUT/r/fused_check.log 2>&1
  tail -1 $OUT/r/fused_check.log
  for preset in llama70b_mlp llama8b_mlp comm_heavy; do
    for op in ag rs; do
      timeout 60 python3 -m commgemm tune --op $op --preset $preset --iters 12 2>&1 | tail -2
    done
  done 2>&1 | tee $OUT/r/tune.log
elif [ "$1" = 2 ]; then
  cp "$2" $OUT/r/tune.json
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 170 python3 benchmarks/fused_check.py \
    --out $OUT/r --name fused_check2 --shapes 3 --tilings fused-w8,fused-wgm,fused-gm-w8 \
    > $OUT/r/fused_check2.log 2>&1
  tail -1 $OUT/r/fused_check2.log
  for preset in llama70b_mlp llama8b_mlp comm_heavy; do
    timeout 70 python3 -m commgemm tune --op ag --preset $preset --iters 12 \
      --methods fused-w8,fused-gm,fused-gm-w8,fused-w16,fused-wgm-w8 2>&1 | tail -9
  done 2>&1 | tee $OUT/r/tune2.log
elif [ "$1" = 6 ]; then
  mkdir -p $OUT/r/stage6
  timeout 150 python3 benchmarks/fused_check.py --out $OUT/r --name direct_check \
    --base fused-direct --ops rs --no-grads --tilings fused-direct-w8,fused-direct-wgm \
    > $OUT/r/direct_check.log 2>&1
  direct=$?
  tail -4 $OUT/r/direct_check.log
  rs_methods=none,fused,fused-w8
  [ $direct = 0 ] && rs_methods=$rs_methods,fused-direct,fused-direct-w8,fused-direct-wgm
  for preset in llama8b_mlp comm_heavy llama70b_mlp; do
    timeout 120 python3 -m commgemm bench --op rs --preset $preset --iters 30 --spans 8 \
      --methods $rs_methods --json $OUT/r/stage6/$preset-rs.json 2>&1 | tail -13
  done 2>&1 | tee $OUT/r/stage6.log
  timeout 120 python3 -m commgemm bench --op ag --preset comm_heavy --iters 30 --spans 8 \
    --methods none,fused,fused-w8,fused-w4,fused-w16,fused-m256-n64-w8,fused-gm-w4,fused-wgm-w8 \
    --json $OUT/r/stage6/comm_heavy-ag.json 2>&1 | tail -14 | tee -a $OUT/r/stage6.log
elif [ "$1" = 7 ]; then
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 150 python3 benchmarks/fused_check.py \
    --out $OUT/r --name check7_direct --base fused-direct --ops rs --shapes 1,3 --tilings "" \
    > $OUT/r/check7_direct.log 2>&1
  tail -1 $OUT/r/check7_direct.log
  for preset in llama70b_mlp llama8b_mlp comm_heavy; do
    for op in ag rs; do
      timeout 90 python3 -m commgemm tune --op $op --preset $preset --iters 30 2>&1 | tail -14
    done
  done 2>&1 | tee $OUT/r/tune7.log | grep -E "best|timed out|Error|periods"
elif [ "$1" = 8 ]; then
  cp "$2" $OUT/r/tune.json
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 80 python3 benchmarks/fused_check.py \
    --out $OUT/r --name check8_default --shapes 2 --tilings "" > $OUT/r/check8_default.log 2>&1
  tail -1 $OUT/r/check8_default.log
  suite suite8 470 330
elif [ "$1" = 9 ]; then
  cp "$2" $OUT/r/tune.json
  suite suite9 540 360
elif [ "$1" = 10 ]; then
  for base in fused fused-direct; do
    ops=ag,rs; [ $base = fused-direct ] && ops=rs
    XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 python3 benchmarks/fused_check.py \
      --out $OUT/r --name repeat_$base --base $base --ops $ops --shapes 2,3 --no-grads \
      --tilings "" --repeat 24 > $OUT/r/repeat_$base.log 2>&1
    grep -E "calls|fused check" $OUT/r/repeat_$base.log
  done
elif [ "$1" = 11 ]; then
  mkdir -p $OUT/r/levers
  for mode in default:"" cublas:--xla_gpu_enable_triton_gemm=false \
      autotune0:--xla_gpu_autotune_level=0; do
    XLA_FLAGS="${mode#*:}" timeout 80 python3 benchmarks/gemm_lead.py --out $OUT/r/levers \
      --name ${mode%%:*} 2>&1 | tail -1
  done | tee $OUT/r/levers/gemm_lead.log
  for mode in default:"" no_lhs:--xla_gpu_enable_latency_hiding_scheduler=false; do
    for problem in comm_heavy:ag llama8b_mlp:rs; do
      XLA_FLAGS="${mode#*:}" timeout 100 python3 -m commgemm bench --op ${problem#*:} \
        --preset ${problem%:*} --iters 30 \
        --methods none,pipeline:4,ring,ring:2,ring-bidi,ring-bidi:2,ring-agg,fused \
        --json $OUT/r/levers/${mode%%:*}-${problem%:*}-${problem#*:}.json 2>&1 | tail -14
    done
  done 2>&1 | tee $OUT/r/levers/bench.log
elif [ "$1" = 12 ]; then
  cp "$2" $OUT/r/tune.json
  timeout 60 python3 benchmarks/gemm_lead.py --out $OUT/r --name comm_heavy_ag \
    --shape 16384,8192,2048 2>&1 | tail -1
  suite suite12 480 330
elif [ "$1" = 13 ]; then
  timeout 120 python3 benchmarks/fused_check.py --out $OUT/r --name check13_direct \
    --base fused-direct --ops rs --no-grads --tilings fused-direct-w16 --repeat 24 \
    > $OUT/r/check13_direct.log 2>&1 && tail -1 $OUT/r/check13_direct.log \
    && timeout 200 python3 benchmarks/ab_scatter_add.py --out $OUT/r 2>&1 | tail -6
  tail -2 $OUT/r/check13_direct.log
elif [ "$1" = 17 ]; then
  for preset in llama70b_mlp llama8b_mlp comm_heavy; do
    for op in ag rs; do
      timeout 90 python3 -m commgemm tune --op $op --preset $preset --iters 5 --periods 6 \
        2>&1 | tail -16
    done
  done 2>&1 | tee $OUT/r/tune17.log | grep -E "best|timed out|Error|periods"
elif [ "$1" = 19 ]; then
  cp "$2" $OUT/r/tune.json
  {
    timeout 120 python3 benchmarks/fused_check.py --out $OUT/r --name check19_ag --ops ag \
      --base fused-direct --tilings fused-direct-gm,fused-direct-cm --no-grads --repeat 24
    timeout 70 python3 benchmarks/fused_check.py --out $OUT/r --name check19_rs --ops rs \
      --shapes 3 --base fused-direct-cm-d1 --tilings fused-direct-cm-ct,fused-direct-d1 \
      --no-grads --repeat 24
  } > $OUT/r/check19.log 2>&1
  grep -c '"ok": true' $OUT/r/check19.log; grep '"ok": false' $OUT/r/check19.log | cut -c1-300
  ag="fused,fused-w16,fused-gm,fused-direct,fused-direct-w16,fused-direct-gm,fused-direct-cm"
  rs="fused-direct-cm,fused-direct-cm-w16,fused-direct-cm-d1,fused-direct-cm-ct,fused-direct-d1"
  rs="$rs,fused-direct-ct"
  end=$((SECONDS + 360))  # the tunes' share of the call; the tar at the end must still run
  for preset in comm_heavy llama8b_mlp llama70b_mlp llama13b_mlp; do
    cache=$OUT/r/tune.json
    [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
    for op in ag rs; do
      methods=$ag; [ $op = rs ] && methods=$rs
      left=$((end - SECONDS)); [ $left -gt 75 ] && left=75
      [ $left -lt 20 ] && { echo "skipped $op $preset: out of time"; continue; }
      COMMGEMM_TUNE_CACHE=$cache timeout $left python3 -m commgemm tune --op $op \
        --preset $preset --iters 5 --periods 6 --methods $methods 2>&1 | tail -12
    done
  done 2>&1 | tee $OUT/r/tune19.log | grep -E "best|timed out|Error|periods|skipped"
elif [ "$1" = 20 ]; then
  cp "$2" $OUT/r/tune.json
  timeout 120 python3 benchmarks/fused_check.py --out $OUT/r --name check20_ag --ops ag \
    --base fused-direct --tilings fused-direct-gm,fused-direct-cm,fused-direct-p1 --no-grads \
    --repeat 24 > $OUT/r/check20.log 2>&1
  tail -1 $OUT/r/check20.log; grep '"ok": false' $OUT/r/check20.log | cut -c1-300
  ag="fused,fused-w16,fused-gm,fused-direct,fused-direct-w16,fused-direct-gm,fused-direct-p1"
  end=$((SECONDS + 330))
  for preset in comm_heavy llama8b_mlp llama70b_mlp llama13b_mlp; do
    cache=$OUT/r/tune.json
    [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
    left=$((end - SECONDS)); [ $left -gt 80 ] && left=80
    [ $left -lt 20 ] && { echo "skipped $preset: out of time"; continue; }
    COMMGEMM_TUNE_CACHE=$cache timeout $left python3 -m commgemm tune --op ag \
      --preset $preset --iters 5 --periods 6 --methods $ag 2>&1 | tail -12
  done 2>&1 | tee $OUT/r/tune20.log | grep -vE "^\s*$|━|┏|┗|┡|└"
elif [ "$1" = 22 ]; then
  cp "$2" $OUT/r/tune.json
  {
    timeout 80 python3 -m commgemm tune --op ag --preset comm_heavy --iters 5 --periods 6 \
      --methods fused,fused-gm,fused-direct,fused-direct-w16,fused-direct-cm,fused-direct-cm-gm,fused-direct-cm-w16
    timeout 80 python3 -m commgemm tune --op rs --preset llama70b_mlp --iters 5 --periods 6 \
      --methods fused-direct,fused-direct-d1,fused-direct-ct,fused-direct-cm,fused-direct-cm-w16
  } 2>&1 | tee $OUT/r/tune22.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  timeout 400 python3 benchmarks/gpu_suite.py --out $OUT/r/suite22 --iters 15 --spans 0 \
    --periods 6 --timeout 300 --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite22.log \
    | grep -E "^\||timed out"
elif [ "$1" = 23 ]; then
  cp "$2" $OUT/r/tune.json
  timeout 80 python3 benchmarks/fused_check.py --out $OUT/r --name check23_rs --ops rs \
    --base fused-direct-pp-s3 --tilings fused-direct-pp-s3-w16,fused-direct-pp-s2 --no-grads \
    --repeat 24 > $OUT/r/check23.log 2>&1
  tail -1 $OUT/r/check23.log; grep '"ok": false' $OUT/r/check23.log | cut -c1-300
  rs="fused-direct-cm,fused-direct-cm-ct,fused-direct-pp-s3,fused-direct-pp-s3-w16"
  rs="$rs,fused-direct-pp-s3-gm,fused-direct-pp-s2"
  for preset in llama8b_mlp comm_heavy llama13b_mlp; do
    cache=$OUT/r/tune.json
    [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
    COMMGEMM_TUNE_CACHE=$cache timeout 60 python3 -m commgemm tune --op rs --preset $preset \
      --iters 5 --periods 6 --methods $rs 2>&1 | tail -10
  done 2>&1 | tee $OUT/r/tune23.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  timeout 300 python3 benchmarks/gpu_suite.py --out $OUT/r/suite23 --iters 15 --spans 0 \
    --periods 6 --timeout 240 --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite23.log \
    | grep -E "^\||timed out" | tail -10
elif [ "$1" = 24 ]; then
  cp "$2" $OUT/r/tune.json
  [ -n "${3:-}" ] && cp "$3" $OUT/r/tune13b.json
  wide=fused-direct-wgm-cm-m64-n256
  {
    timeout 90 python3 benchmarks/fused_check.py --out $OUT/r --name check24_rs --ops rs \
      --shapes 2,3 --base fused-direct-cm-t2 --tilings fused-direct-cm-ct-t0,$wide,$wide-t0 \
      --no-grads --repeat 24
    timeout 50 python3 benchmarks/fused_check.py --out $OUT/r --name check24_ag --ops ag \
      --shapes 2,3 --base $wide --tilings "" --no-grads --repeat 24
  } > $OUT/r/check24.log 2>&1
  grep -c '"ok": true' $OUT/r/check24.log; grep '"ok": false' $OUT/r/check24.log | cut -c1-300
  rs="fused-direct-cm,fused-direct-cm-ct,fused-direct-cm-t0,fused-direct-cm-ct-t0,$wide"
  rs="$rs,$wide-t0,fused-direct-wgm-cm-ct-m64-n256-t0"
  end=$((SECONDS + 320))
  for preset in llama8b_mlp comm_heavy llama13b_mlp llama70b_mlp; do
    cache=$OUT/r/tune.json
    [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
    left=$((end - SECONDS)); [ $left -gt 90 ] && left=90
    [ $left -lt 25 ] && { echo "skipped rs $preset: out of time"; continue; }
    COMMGEMM_TUNE_CACHE=$cache timeout $left python3 -m commgemm tune --op rs --preset $preset \
      --iters 5 --periods 6 --methods $rs 2>&1 | tail -11
  done 2>&1 | tee $OUT/r/tune24.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  left=$((end + 60 - SECONDS)); [ $left -gt 60 ] && left=60
  timeout $left python3 -m commgemm tune --op ag --preset comm_heavy --iters 5 --periods 6 \
    --methods fused-direct-cm,fused-direct-cm-w16,$wide,$wide-w16 2>&1 | tail -8 \
    | tee -a $OUT/r/tune24.log | grep -vE "^\s*$|━|┏|┗|┡|└"
elif [ "$1" = 26 ]; then
  cp "$2" $OUT/r/tune.json
  [ -n "${3:-}" ] && cp "$3" $OUT/r/tune13b.json
  base=fused-direct-wgm-cm-ct-m64-n256
  timeout 80 python3 benchmarks/fused_check.py --out $OUT/r --name check26_rs --ops rs \
    --shapes 2,3 --base $base-t0 --tilings $base-w16-t0,fused-direct-wgm-cm-m64-n256-d1-t0 \
    --no-grads --repeat 24 > $OUT/r/check26.log 2>&1
  tail -1 $OUT/r/check26.log; grep '"ok": false' $OUT/r/check26.log | cut -c1-300
  rs="$base-t0,$base-w4-t0,$base-w16-t0,fused-direct-wgm-gm-cm-ct-m64-n256-t0"
  rs="$rs,fused-direct-wgm-cm-m64-n256-d1-t0,fused-direct-cm-ct-t0"
  for preset in llama8b_mlp llama13b_mlp; do
    cache=$OUT/r/tune.json
    [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
    COMMGEMM_TUNE_CACHE=$cache timeout 110 python3 -m commgemm tune --op rs --preset $preset \
      --iters 5 --periods 6 --methods $rs 2>&1 | tail -10
  done 2>&1 | tee $OUT/r/tune26.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  timeout 90 python3 -m commgemm tune --op ag --preset comm_heavy --iters 5 --periods 6 \
    --methods fused-direct-cm,fused-direct-cm-w4,fused-direct-cm-w16,fused-direct-cm-p4,fused-direct-cm-p16 \
    2>&1 | tail -9 | tee -a $OUT/r/tune26.log | grep -vE "^\s*$|━|┏|┗|┡|└"
elif [ "$1" = 27 ]; then
  cp "$2" $OUT/r/tune.json
  [ -n "${3:-}" ] && cp "$3" $OUT/r/tune13b.json
  best=fused-direct-wgm-cm-ct-m64-n256
  {
    timeout 110 python3 benchmarks/fused_check.py --out $OUT/r --name check27_ps --ops rs \
      --shapes 0,1,2,3 --base fused-direct-cm-ps --tilings fused-direct-ps --no-grads \
      --repeat 24
    timeout 60 python3 benchmarks/fused_check.py --out $OUT/r --name check27_ps_t0 --ops rs \
      --shapes 3 --base fused-direct-wgm-cm-ct-ps-m64-n256-t0 --tilings "" --no-grads \
      --repeat 24
  } > $OUT/r/check27.log 2>&1
  grep 'fused check' $OUT/r/check27.log; grep -E '"ok": false|Error|rror:' $OUT/r/check27.log \
    | cut -c1-300 | head -8
  if [ $(grep -c 'ok=True' $OUT/r/check27.log) = 2 ]; then
    rs="$best-t0,fused-direct-wgm-cm-ct-ps-m64-n256-t0,fused-direct-cm-ps"
    rs="$rs,fused-direct-cm-ct-ps-t0"
    for preset in llama8b_mlp comm_heavy llama13b_mlp; do
      cache=$OUT/r/tune.json
      [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
      COMMGEMM_TUNE_CACHE=$cache timeout 80 python3 -m commgemm tune --op rs \
        --preset $preset --iters 5 --periods 6 --methods $rs 2>&1 | tail -8
    done 2>&1 | tee $OUT/r/tune27.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  fi
elif [ "$1" = 30 ]; then
  cp "$2" $OUT/r/tune.json
  {
    timeout 170 python3 benchmarks/fused_check.py --out $OUT/r --name check30_ag --ops ag \
      --shapes 2,3 --base fused-direct-cm-r100 \
      --tilings fused-direct-cm-r50,fused-direct-gm-r90,fused-direct-r100 --no-grads --repeat 24
    timeout 80 python3 benchmarks/fused_check.py --out $OUT/r --name check30_rs --ops rs \
      --shapes 2,3 --base fused --tilings "" --no-grads --repeat 24
  } > $OUT/r/check30.log 2>&1
  grep 'fused check' $OUT/r/check30.log; grep -E '"ok": false|Error|rror:' $OUT/r/check30.log \
    | cut -c1-300 | head -8
  if ! grep -q '"ok": false' $OUT/r/check30.log \
    && grep -q '"spec": "fused-direct-r100"' $OUT/r/check30.log; then
    ag="fused-direct-cm,fused-direct-cm-r50,fused-direct-cm-r75,fused-direct-cm-r90"
    timeout 150 python3 -m commgemm tune --op ag --preset comm_heavy --iters 5 --periods 6 \
      --methods $ag,fused-direct-cm-r100,fused-direct-r100 2>&1 | tail -10 \
      | tee $OUT/r/tune30.log | grep -vE "^\s*$|━|┏|┗|┡|└"
    timeout 110 python3 -m commgemm tune --op ag --preset llama8b_mlp --iters 5 --periods 6 \
      --methods fused-direct-gm,fused-direct-gm-r50,fused-direct-gm-r100,fused-direct-cm-r100 \
      2>&1 | tail -8 | tee -a $OUT/r/tune30.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  fi
elif [ "$1" = 32 ]; then
  cp "$2" $OUT/r/tune.json
  best=fused-direct-wgm-cm-ct-m64-n256-t0
  timeout 150 python3 benchmarks/fused_check.py --out $OUT/r --name check32_rs --ops rs \
    --shapes 2,3 --base fused-direct-wgm-cm-m64-n256-t0-l66 \
    --tilings $best-l66,fused-direct-cm-l8,fused-direct-l2000 --no-grads --repeat 24 \
    > $OUT/r/check32.log 2>&1
  grep 'fused check' $OUT/r/check32.log; grep -E '"ok": false|Error|rror:' $OUT/r/check32.log \
    | cut -c1-300 | head -8
  if ! grep -q '"ok": false' $OUT/r/check32.log \
    && grep -q '"spec": "fused-direct-l2000"' $OUT/r/check32.log; then
    for preset in llama8b_mlp comm_heavy; do
      timeout 120 python3 -m commgemm tune --op rs --preset $preset --iters 5 --periods 6 \
        --methods $best,$best-l22,$best-l66,$best-l132 2>&1 | tail -8
    done 2>&1 | tee $OUT/r/tune32.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  fi
elif [ "$1" = 34 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256-t0
  timeout 130 python3 benchmarks/kernel_profile.py --out $OUT/r --name profile34 --problems \
    llama8b_mlp:$base,llama8b_mlp:$base@store,llama8b_mlp:$base@add-late-zero,comm_heavy:$base \
    > $OUT/r/profile34.log 2>&1
  grep -vE "Warning|warn" $OUT/r/profile34.log | cut -c1-900 | tail -8
  rs="$base,$base@add-late-zero,fused-direct-wgm-cm-ct-m64-n256-e32-t0"
  rs="$rs,fused-direct-wgm-cm-ct-m64-n256-k128-s2-t0,fused-direct-wgm-cm-ct-m64-n256-s3-t0"
  rs="$rs,$base@add-unzeroed,$base@store,$base@local-add,$base@remote-store,mosaic"
  timeout 380 python3 benchmarks/probe.py --out $OUT/r --name probe34 --rounds 8 --iters 10 \
    --problems rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp --rs $rs \
    2>&1 | tee $OUT/r/probe34.log | grep -vE "^\s*$|Warning|warn"
elif [ "$1" = 35 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256
  timeout 200 python3 benchmarks/fused_check.py --out $OUT/r --name check35_rs --ops rs \
    --shapes 3 --base $base-z2-t0 --tilings $base-z1-t0,fused-direct-cm-ct-z3-t0,fused-direct-z2 \
    --no-grads --repeat 24 > $OUT/r/check35.log 2>&1
  grep 'fused check' $OUT/r/check35.log; grep -E '"ok": false|Error|rror:' $OUT/r/check35.log \
    | cut -c1-300 | head -8
  if ! grep -q '"ok": false' $OUT/r/check35.log \
    && grep -q '"spec": "fused-direct-z2"' $OUT/r/check35.log; then
    rs="$base-t0,$base-z1-t0,$base-z2-t0,$base-z3-t0,$base-z4-t0,fused-direct-cm-ct-t0"
    rs="$rs,fused-direct-cm-ct-z2-t0,$base-t0@add-unzeroed"
    timeout 250 python3 benchmarks/probe.py --out $OUT/r --name probe35 --rounds 8 --iters 10 \
      --problems rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp --rs $rs \
      2>&1 | tee $OUT/r/probe35.log | grep -vE "^\s*$|Warning|warn"
    timeout 60 python3 benchmarks/kernel_profile.py --out $OUT/r --name profile35 \
      --problems llama8b_mlp:$base-z2-t0 > $OUT/r/profile35.log 2>&1
    grep -vE "Warning|warn" $OUT/r/profile35.log | cut -c1-1200 | tail -3
  fi
elif [ "$1" = 39 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256
  if rs_check check39 180 $base-a3-t0 $base-a1-t0,$base-a6-t0,fused-direct-cm-a2,fused-direct-a1
  then
    rs="$base-t0,$base-a1-t0,$base-a2-t0,$base-a3-t0,$base-a5-t0,$base-k128-s2-a3-t0"
    rs="$rs,$base-t0@add-unzeroed"
    timeout 280 python3 benchmarks/probe.py --out $OUT/r --name probe39 --rounds 8 --iters 10 \
      --problems rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp --rs $rs \
      2>&1 | tee $OUT/r/probe39.log | grep -vE "^\s*$|Warning|warn"
    timeout 70 python3 benchmarks/kernel_profile.py --out $OUT/r --name profile39 \
      --problems llama8b_mlp:$base-a3-t0,llama8b_mlp:$base-t0 > $OUT/r/profile39.log 2>&1
    grep -vE "Warning|warn" $OUT/r/profile39.log | cut -c1-1200 | tail -3
  fi
elif [ "$1" = 40 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256-a3-t0
  rs="fused-direct-wgm-cm-ct-m64-n256-t0,$base,$base@add-ahead-nowait,$base@add-ahead-nosync"
  rs="$rs,$base@add-ahead-nostore,fused-direct-wgm-cm-ct-m64-n256-t0@add-unzeroed"
  timeout 200 python3 benchmarks/probe.py --out $OUT/r --name probe40 --rounds 8 --iters 10 \
    --problems rs:llama8b_mlp,rs:comm_heavy --rs $rs \
    2>&1 | tee $OUT/r/probe40.log | grep -vE "^\s*$|Warning|warn"
  nc=fused-direct-wgm-cm-m64-n256-s3
  timeout 90 python3 benchmarks/kernel_profile.py --out $OUT/r --name profile40 \
    --problems llama8b_mlp:$nc-a3-t0,llama8b_mlp:$nc-t0 > $OUT/r/profile40.log 2>&1
  grep -vE "Warning|warn" $OUT/r/profile40.log | cut -c1-1200 | tail -3
elif [ "$1" = 41 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256
  if rs_check check41 150 $base-a3-t0 $base-a1-t0,$base-a6-t0,fused-direct-cm-a2,fused-direct-a1
  then
    rs="$base-t0,$base-a2-t0,$base-a3-t0,$base-a4-t0,$base-a6-t0,$base-a3-t0@add-ahead-release"
    rs="$rs,$base-t0@add-unzeroed"
    timeout 280 python3 benchmarks/probe.py --out $OUT/r --name probe41 --rounds 8 --iters 10 \
      --problems rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp --rs $rs \
      2>&1 | tee $OUT/r/probe41.log | grep -vE "^\s*$|Warning|warn"
  fi
elif [ "$1" = 42 ]; then
  cp "$2" $OUT/r/tune.json
  base=fused-direct-wgm-cm-ct-m64-n256
  if rs_check check42 150 $base-a2-t0 $base-a1-t0,$base-a6-t0,fused-direct-cm-a2,fused-direct-a1
  then
    rs="$base-t0,$base-a2-t0,$base-a3-t0,$base-a6-t0,$base-k128-s2-a2-t0"
    for preset in llama8b_mlp comm_heavy llama13b_mlp; do
      cache=$OUT/r/tune.json
      [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
      COMMGEMM_TUNE_CACHE=$cache timeout 100 python3 -m commgemm tune --op rs --preset $preset \
        --iters 5 --periods 6 --methods $rs 2>&1 | tail -9
    done 2>&1 | tee $OUT/r/tune42.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  fi
elif [ "$1" = 44 ]; then
  base=fused-direct-wgm-cm-ct-m64-n256
  rs_check check44 150 $base-k128-s2-t0-a2 $base-t0-a3,fused-direct-cm-ct-t0,fused-direct-cm,fused-direct-a1
  rs_ok=$?
  timeout 150 python3 benchmarks/fused_check.py --out $OUT/r --name check44_ag --ops ag \
    --shapes 3 --base fused-direct-gm --tilings fused-direct-cm-r100,fused-direct-w16 \
    --no-grads --repeat 24 > $OUT/r/check44_ag.log 2>&1
  grep 'fused check' $OUT/r/check44_ag.log; grep -E '"ok": false|Error|rror:' \
    $OUT/r/check44_ag.log | cut -c1-300 | head -8
  if [ $rs_ok = 0 ] && ! grep -q '"ok": false' $OUT/r/check44_ag.log \
    && grep -q '"spec": "fused-direct-w16"' $OUT/r/check44_ag.log; then
    rs="$base-k128-s2-t0-a2,$base-k128-s2-t0-a2@add-fenced,$base-t0-a2,$base-t0-a2@add-fenced"
    rs="$rs,fused-direct-cm-ct-t0,fused-direct-cm-ct-t0@add-fenced"
    ag="fused-direct-gm,fused-direct-gm@fenced,fused-direct-cm-r100,fused-direct-cm-r100@fenced"
    problems=rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp
    timeout 330 python3 benchmarks/probe.py --out $OUT/r --name probe44 --rounds 8 --iters 10 \
      --problems $problems,ag:llama8b_mlp,ag:comm_heavy,ag:llama13b_mlp --rs $rs --ag $ag \
      2>&1 | tee $OUT/r/probe44.log | grep -vE "^\s*$|Warning|warn"
  fi
elif [ "$1" = 46 ]; then
  cp "$2" $OUT/r/tune.json
  base=fused-direct-wgm-cm-ct-m64-n256-k128-s2-t0-a2
  rs="$base,$base@add-fenced,fused-direct-cm-ct-t0,fused-direct-cm-ct-t0@add-fenced"
  timeout 150 python3 benchmarks/probe.py --out $OUT/r --name probe46 --rounds 8 --iters 10 \
    --problems rs:llama8b_mlp,rs:comm_heavy,rs:llama13b_mlp,rs:llama70b_mlp --rs $rs \
    2>&1 | tee $OUT/r/probe46.log | grep -vE "^\s*$|Warning|warn"
  periods_suite suite46 420
elif [ "$1" = 36 ]; then
  cp "$2" $OUT/r/tune.json
  [ -n "${3:-}" ] && cp "$3" $OUT/r/tune13b.json
  wide=fused-direct-wgm-cm-ct-m64-n256
  timeout 150 python3 benchmarks/fused_check.py --out $OUT/r --name check36_rs --ops rs \
    --shapes 3 --base $wide-k128-s2-t0 --tilings fused-direct-cm-ct-k128-s2-t0,fused-direct-k128-s2 \
    --no-grads --repeat 24 > $OUT/r/check36.log 2>&1
  grep 'fused check' $OUT/r/check36.log; grep -E '"ok": false|Error|rror:' $OUT/r/check36.log \
    | cut -c1-300 | head -8
  if ! grep -q '"ok": false' $OUT/r/check36.log \
    && grep -q '"spec": "fused-direct-k128-s2"' $OUT/r/check36.log; then
    rs="$wide-t0,$wide-k128-s2-t0,$wide-k128-s2-w16-t0,fused-direct-cm-ct-t0"
    rs="$rs,fused-direct-cm-ct-k128-s2-t0"
    for preset in llama8b_mlp comm_heavy llama70b_mlp llama13b_mlp; do
      cache=$OUT/r/tune.json
      [ $preset = llama13b_mlp ] && cache=$OUT/r/tune13b.json
      COMMGEMM_TUNE_CACHE=$cache timeout 90 python3 -m commgemm tune --op rs --preset $preset \
        --iters 5 --periods 6 --methods $rs 2>&1 | tail -9
    done 2>&1 | tee $OUT/r/tune36.log | grep -vE "^\s*$|━|┏|┗|┡|└"
  fi
elif [ "$1" = 25 ] || [ "$1" = 28 ] || [ "$1" = 29 ] || [ "$1" = 31 ] || [ "$1" = 33 ] \
    || [ "$1" = 37 ] || [ "$1" = 38 ] || [ "$1" = 43 ] || [ "$1" = 45 ]; then
  cp "$2" $OUT/r/tune.json
  periods_suite suite$1 540
elif [ "$1" = 18 ] || [ "$1" = 21 ]; then
  cp "$2" $OUT/r/tune.json
  periods_suite suite$1 570
elif [ "$1" = 5 ]; then
  cp "$2" $OUT/r/tune.json
  timeout 430 python3 benchmarks/gpu_suite.py --out $OUT/r/suite --iters 6 --rounds 5 \
    --timeout 280 --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite.log \
    | grep -E "^\[|^\||timed out"
elif [ "$1" = 4 ]; then
  cp "$2" $OUT/r/tune.json
  {
    timeout 60 python3 -m commgemm tune --op rs --preset comm_heavy --iters 10 --rounds 2 \
      --methods fused,fused-w8,fused-s3-e128,fused-w8-s3-e128,fused-gm-w8 | tail -8
    timeout 60 python3 -m commgemm tune --op rs --preset llama8b_mlp --iters 10 --rounds 2 \
      --methods fused,fused-w8,fused-wgm,fused-s3-e128,fused-w8-s3-e128 | tail -8
    timeout 60 python3 -m commgemm tune --op ag --preset comm_heavy --iters 10 --rounds 2 \
      --methods fused-w8,fused-gm-w8,fused-gm-w16,fused-gm-w8-s3-e128 | tail -7
  } 2>&1 | tee $OUT/r/tune4.log
  timeout 400 python3 benchmarks/gpu_suite.py --out $OUT/r/suite --iters 10 --rounds 3 \
    --timeout 250 --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite.log \
    | grep -E "^\[|^\||timed out"
else
  cp "$2" $OUT/r/tune.json
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 python3 benchmarks/fused_check.py \
    --out $OUT/r --name fused_check3 --shapes 2 --tilings fused-w8,fused-wgm,fused-gm-w8 \
    > $OUT/r/fused_check3.log 2>&1
  tail -1 $OUT/r/fused_check3.log
  timeout 420 python3 benchmarks/gpu_suite.py --out $OUT/r/suite --iters 25 --timeout 200 \
    --modes default,windowed_einsum 2>&1 | tee $OUT/r/suite.log | grep -E "^\[|^\||timed out"
fi
tar czf $OUT/results.tgz -C $OUT r && rm -rf $OUT/r
