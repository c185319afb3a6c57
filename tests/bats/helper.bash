# helper.bash: loaded by every bats file. Finds the programs under test through $DFL_BIN (the
# build tree by default, an install when set), loads bats-assert, and gives small helpers.
: "${DFL_BUILD:=$(cd "$BATS_TEST_DIRNAME/../../build" 2>/dev/null && pwd)}"
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

# require_oracle: skip the test when the shared reference outputs are not there.
require_oracle() {
    [ -n "$DFL_ORACLE" ] && [ -f "$DFL_ORACLE/README.md" ] || skip "no oracle directory (set DFL_ORACLE)"
}
