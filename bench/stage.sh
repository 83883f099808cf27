# Sourced by the one-call GPU scripts (gpu_all.sh, gpu_head.sh): run a stage under its own time limit.
# Needs OUT and LIMIT (seconds for the whole call); STAGE_MIN_S: skip a stage with less left (default 30);
# STAGE_TAIL: lines of its log echoed (default 30).
stage() {  # stage NAME SECONDS COMMAND...: at most SECONDS, and never past LIMIT
  local name=$1 want=$2; shift 2
  [ "$want" -le 0 ] && { echo "$name: skipped (0 s asked)"; return; }  # (timeout 0 would mean no limit at all)
  local left=$((LIMIT - SECONDS - 10))
  [ "$left" -lt "${STAGE_MIN_S:-30}" ] && { echo "$name: skipped (no time left)"; return; }
  [ "$want" -gt "$left" ] && want=$left
  timeout "$want" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"; grep -v "^{" "$OUT/$name.log" | grep -v "it/s\]" | tail -n "${STAGE_TAIL:-30}"
}
