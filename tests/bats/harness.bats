#!/usr/bin/env bats
# The test binaries' own rules (tests/unit/t.h) where a wrong set-up would hide cases: an oracle
# directory copied without the oracles' README.md fails the oracle cases instead of skipping them
# unseen; an oracle directory that is not there skips them, as on a machine without the oracles.
load helper
bats_require_minimum_version 1.5.0

@test "oracle cases: a directory without README.md fails them, saying so; no directory skips them" {
    mkdir -p "$BATS_TEST_TMPDIR/orc/qwen3moe-tiny-a"
    run -1 env DFL_ORACLE="$BATS_TEST_TMPDIR/orc" T_ONLY=oracle "${DFL_TESTBIN:-$DFL_BUILD/tests}/test-families"
    assert_output --partial "not ok - test_qwen3moe_oracle"
    assert_output --partial "is a directory without the oracles' README.md"
    run env DFL_ORACLE="$BATS_TEST_TMPDIR/none" T_ONLY=oracle "${DFL_TESTBIN:-$DFL_BUILD/tests}/test-families"
    assert_output --partial "ok - test_qwen3moe_oracle # skip"
    refute_output --partial "not ok"
    [ "$status" = 77 ]   # every case run skipped
}
