#!/usr/bin/env bats
# .ci/install-deps, the one list of packages, and the set-up that `make demo` and `make check`
# run through it (.ci/install-deps --ensure): what it reports, installs and says, against shims
# of dpkg-query, id, sudo and apt-get (nothing is installed: apt-get only records its arguments).
load helper
bats_require_minimum_version 1.5.0

setup() {
    T="$BATS_TEST_TMPDIR"
    S="$T/shim"
    mkdir -p "$S"
    # dpkg-query -W -f=FMT PKG...: every package installed but those in $FAKE_MISSING
    cat > "$S/dpkg-query" <<'SH'
#!/usr/bin/env bash
for a in "$@"; do
    case "$a" in -*) continue ;; esac
    case " $FAKE_MISSING " in *" $a "*) echo "dpkg-query: no packages found matching $a" >&2 ;;
    *) echo "$a install ok installed" ;; esac
done
SH
    cat > "$S/id" <<'SH'
#!/usr/bin/env bash
[ "$1" = -u ] && echo "${FAKE_UID:-0}"
SH
    cat > "$S/sudo" <<'SH'
#!/usr/bin/env bash
echo "sudo $*" >> "$FAKE_LOG"
[ "${FAKE_SUDO_OK:-1}" = 1 ] || { echo "sudo: a password is required" >&2; exit 1; }
exec "$@"
SH
    cat > "$S/apt-get" <<'SH'
#!/usr/bin/env bash
echo "apt-get $* (DEBIAN_FRONTEND=$DEBIAN_FRONTEND)" >> "$FAKE_LOG"
exit "${FAKE_APT_RC:-0}"
SH
    chmod +x "$S"/*
    export FAKE_LOG="$T/log" FAKE_MISSING="" PATH="$S:$PATH"
    unset MAKEFLAGS MFLAGS MAKELEVEL DEPS   # the nested makes below are plain ones
    touch "$FAKE_LOG"
}

@test "--check: reports what is missing and the apt-get command, installs nothing" {
    run -0 "$REPO/.ci/install-deps" --check
    [[ "$output" == "install-deps: all 24 packages present" ]]
    FAKE_MISSING="bats mandoc" run -1 "$REPO/.ci/install-deps" --check
    [[ "$output" == *"install-deps: missing: bats mandoc"* ]]
    [[ "$output" == *"as root: apt-get update && apt-get install -y --no-install-recommends bats mandoc"* ]]
    [ ! -s "$FAKE_LOG" ]
}

@test "--ensure: silent when nothing is missing; as root installs what is missing, saying so" {
    run -0 --separate-stderr "$REPO/.ci/install-deps" --ensure
    [ -z "$output$stderr" ]
    [ ! -s "$FAKE_LOG" ]
    FAKE_MISSING="libzstd-dev bats" run -0 --separate-stderr "$REPO/.ci/install-deps" --ensure
    [[ "$stderr" == *"installing libzstd-dev bats (apt-get)"* ]]
    grep -qx "apt-get update -q (DEBIAN_FRONTEND=noninteractive)" "$FAKE_LOG"
    grep -qx "apt-get install -y -q --no-install-recommends libzstd-dev bats (DEBIAN_FRONTEND=noninteractive)" "$FAKE_LOG"
    ! grep -q sudo "$FAKE_LOG"
}

@test "--ensure: not root, through sudo; where sudo or apt-get fails, exit 1 with the exact command" {
    FAKE_UID=1000 FAKE_MISSING=gcc run -0 --separate-stderr "$REPO/.ci/install-deps" --ensure
    [[ "$stderr" == *"installing gcc (apt-get through sudo)"* ]]
    grep -q "^sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc" "$FAKE_LOG"
    FAKE_UID=1000 FAKE_SUDO_OK=0 FAKE_MISSING=gcc run -1 "$REPO/.ci/install-deps" --ensure
    [[ "$output" == *"could not install gcc: as root, run"* ]]
    [[ "$output" == *"  apt-get update && apt-get install -y --no-install-recommends gcc"* ]]
    FAKE_APT_RC=100 FAKE_MISSING=gcc run -1 "$REPO/.ci/install-deps"
    [[ "$output" == *"apt-get update && apt-get install -y --no-install-recommends gcc"* ]]
}

@test "--ensure: not root and no sudo: exit 1 with the command; off Debian: says so, exit 0" {
    B2="$T/bin2"
    mkdir -p "$B2"
    for c in bash env grep sed cat; do ln -s "$(command -v "$c")" "$B2/$c"; done
    ln -s "$S/id" "$B2/id"
    ln -s "$S/dpkg-query" "$B2/dpkg-query"
    FAKE_UID=1000 FAKE_MISSING=mandoc PATH="$B2" run -1 "$REPO/.ci/install-deps" --ensure
    [[ "$output" == *"the build needs mandoc, missing here; not root and no sudo: as root, run"* ]]
    [[ "$output" == *"  apt-get update && apt-get install -y --no-install-recommends mandoc"* ]]
    rm "$B2/dpkg-query"
    PATH="$B2" run -0 "$REPO/.ci/install-deps" --ensure
    [[ "$output" == *"no dpkg-query: not Debian or Ubuntu"* ]]
    PATH="$B2" run -1 "$REPO/.ci/install-deps" --check
}

@test "make check and make demo run the set-up first: a missing package stops make with the command; DEPS=0 skips it" {
    command -v make >/dev/null || skip "no make"
    # (make -n: nothing is built; never a -n of a goal that reaches check's "+" recipe, which
    # would run the whole suite: the failing set-up stops make before any recipe)
    FAKE_UID=1000 FAKE_SUDO_OK=0 FAKE_MISSING=bats-assert run -2 make -n -C "$REPO" check
    [[ "$output" == *"apt-get install -y --no-install-recommends bats-assert"* ]]
    [[ "$output" == *"missing build dependencies"* ]]
    FAKE_UID=1000 FAKE_SUDO_OK=0 FAKE_MISSING=bats-assert run -2 make -n -C "$REPO" demo
    [[ "$output" == *"missing build dependencies"* ]]
    FAKE_UID=1000 FAKE_SUDO_OK=0 FAKE_MISSING=bats-assert run -0 make -n -C "$REPO" DEPS=0 demo
    [[ "$output" != *"missing build dependencies"* ]]
    # as root the set-up installs it and the build goes on
    FAKE_MISSING=bats-assert run -0 make -n -C "$REPO" demo
    [[ "$output" == *"installing bats-assert"* ]]
    grep -q "apt-get install -y -q --no-install-recommends bats-assert" "$FAKE_LOG"
    # make alone (the programs) does not
    FAKE_MISSING=bats-assert run -0 make -n -C "$REPO" all
    [[ "$output" != *"installing"* ]]
}

@test "the README's first block is exactly two commands: make demo, make check" {
    block=$(awk '/^    [^ ]/ { p = 1; print; next } p { exit }' "$REPO/README.md" | sed 's/ *#.*//; s/^ *//')
    [ "$block" = "$(printf 'make demo\nmake check')" ]
}
