# shellcheck shell=bash
# bench/gpu-sampler.sh: sourced by bench/draft and bench/target (bash). A sampler of the GPU's
# memory, power and clocks (nvidia-smi every 200 ms) around a run:
#   smi_init DEVICE     once: samples only where DEVICE is cuda and nvidia-smi is there; memory
#                       alone where nvidia-smi lacks the power and clock fields
#   mem_start FILE      starts the sampler into FILE (nothing without a GPU)
#   mem_stop            stops it
#   peak_mem FILE       -> the largest MiB used, or nothing
#   power_of FILE       -> "W/MHz": the mean power draw and SM clock over the samples at half the
#                       power limit or more (the run's work, not its start or its end), " cap"
#                       added when the power-cap throttle (clocks_throttle_reasons bit 0x4) was on
#                       in most of them; nothing without such samples
#   sustained_rate LOG  -> the rate of bench-ceiling --sustained's last quarter second (its
#                       "sustained:" line in LOG), or nothing
# The caller's EXIT trap should kill "$sampler" when it is set.
have_smi=0
smi_fields=memory.used
sampler=""
smi_init() {
    have_smi=0
    smi_fields=memory.used
    [ "$1" = cuda ] && command -v nvidia-smi >/dev/null 2>&1 || return 0
    have_smi=1
    local all=memory.used,power.draw,power.limit,clocks.sm,clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$all --format=csv,noheader,nounits >/dev/null 2>&1 && smi_fields=$all
    return 0
}
mem_start() {
    sampler=""
    [ "$have_smi" = 1 ] || return 0
    nvidia-smi --query-gpu=$smi_fields --format=csv,noheader,nounits -lms 200 >"$1" 2>/dev/null &
    sampler=$!
}
mem_stop() {
    [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
    sampler=""
}
peak_mem() { [ -s "$1" ] && awk -F, '$1 + 0 > m { m = $1 + 0 } END { if (m) printf "%d", m }' "$1"; }
power_of() {
    [ -s "$1" ] && awk -F', *' 'NF >= 5 && $3 + 0 > 0 && $2 + 0 >= 0.5 * $3 {
        n++; p += $2; c += $4; if (substr($5, length($5), 1) ~ /[4-7c-fC-F]/) cap++ }
        END { if (n) printf "%.0f/%.0f%s", p / n, c / n, (2 * cap > n ? " cap" : "") }' "$1"
}
sustained_rate() { sed -n 's/^sustained: .* last \([0-9.]*\),.*/\1/p' "$1" | tail -1; }
