# helper.bash: loaded by every bats file. Finds the programs under test through $DFL_BIN (the
# build tree by default, an install when set), loads bats-assert, and gives small helpers.
# SAN=1 in the environment picks the sanitized build (make SAN=1) when DFL_BUILD is not set.
if [ "${SAN:-0}" = 1 ]; then _dfl_build_dir=build-san; else _dfl_build_dir=build; fi
: "${DFL_BUILD:=$(cd "$BATS_TEST_DIRNAME/../../$_dfl_build_dir" 2>/dev/null && pwd)}"
# Sanitized programs stop at the first report with status 86, which no test expects
# (tests/run-checks sets these, and more, for make check).
: "${ASAN_OPTIONS:=halt_on_error=1:exitcode=86:detect_leaks=1:protect_shadow_gap=0}"
: "${UBSAN_OPTIONS:=halt_on_error=1:exitcode=86:print_stacktrace=1}"
export ASAN_OPTIONS UBSAN_OPTIONS
: "${DFL_BIN:=$DFL_BUILD/bin}"
: "${DFL_TOOLS:=$DFL_BUILD/tools}"
: "${DFL_ORACLE:=$(cd "$BATS_TEST_DIRNAME/../../../shared/oracle" 2>/dev/null && pwd)}"
export DFL_BIN DFL_TOOLS DFL_ORACLE
PATH="$DFL_BIN:$PATH"
REPO=$(cd "$BATS_TEST_DIRNAME/../.." && pwd)
FIXTURES="$REPO/tests/fixtures"
BAD="$REPO/tests/bad"

for d in /usr/lib/bats /usr/local/lib/bats /opt/homebrew/lib; do
    if [ -f "$d/bats-support/load.bash" ]; then
        load "$d/bats-support/load.bash"
        load "$d/bats-assert/load.bash"
        break
    fi
done

# assert_help PROG WORD...: PROG --help exits 0 with its usage on stdout, holding each WORD, and
# nothing on stderr.
assert_help() {
    local prog=$1 w
    shift
    run -0 --separate-stderr "$prog" --help
    for w in "$@"; do
        assert_output --partial "$w"
    done
    [ -z "$stderr" ]
}

# assert_version PROG: PROG --version exits 0 printing "PROG (dfl) VERSION".
assert_version() {
    run -0 "$1" --version
    assert_output --regexp "^$1 \(dfl\) [0-9]+\.[0-9]+"
}

# require_oracle: skip the test when the shared reference outputs are not there.
require_oracle() {
    [ -n "$DFL_ORACLE" ] && [ -f "$DFL_ORACLE/README.md" ] || skip "no oracle directory (set DFL_ORACLE)"
}
