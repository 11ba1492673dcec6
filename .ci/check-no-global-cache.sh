#!/usr/bin/env bash
# Fails if Rust code under crates/ holds process-wide state that could be a cache keyed by an
# address, pointer, id or name (docs/lifetime.md; DESIGN.md "The invariant"): derived state must
# live in a ResidentSlot owned by its weight. Flagged:
#   - `static mut`, and any `static` whose type has interior mutability or is a collection
#     (Mutex, RwLock, OnceLock, OnceCell, LazyLock, Lazy, RefCell, Cell, UnsafeCell, AtomicPtr,
#     HashMap, BTreeMap, HashSet, BTreeSet, Vec, VecDeque, DashMap);
#   - `thread_local!`, `lazy_static!`, `LazyLock`, `once_cell`, anywhere.
# Allowed: atomic integer/bool statics (vt-cpu's NEXT_INSTANCE id counter) and immutable data.
# The one exception is crates/vt-core/src/mutation.rs, the original bug kept for the lifetime tests'
# mutation arm; this script checks that it is still caught by the patterns (so the check is not
# blind) and that it is compiled only under its feature.
set -euo pipefail
cd "$(dirname "$0")/.."

exception=crates/vt-core/src/mutation.rs

# Prints `file:line: declaration` for every offence in the given files.
scan() {
    perl -0777 -ne '
        my $src = $_;
        $src =~ s{//[^\n]*}{}g;    # comments may mention the patterns
        my $report = sub { my ($pos, $what) = @_; my $line = 1 + (() = substr($src, 0, $pos) =~ /\n/g);
                           $what =~ s/\s+/ /g; $what =~ s/ $//; print "$ARGV:$line: $what\n"; };
        while ($src =~ /\bstatic\s+(mut\s+)?\w+\s*:([^=;]*)/g) {
            my ($mut, $ty, $at, $decl) = ($1, $2, $-[0], $&);
            $report->($at, $decl) if $mut
                || $ty =~ /\b(Mutex|RwLock|OnceLock|OnceCell|LazyLock|Lazy|RefCell|Cell|UnsafeCell|AtomicPtr|HashMap|BTreeMap|HashSet|BTreeSet|Vec|VecDeque|DashMap)\b/;
        }
        while ($src =~ /\b(thread_local!|lazy_static!|LazyLock|once_cell)/g) {
            $report->($-[0], $1);
        }
    ' "$@"
}

if [[ -z "$(scan "$exception")" ]]; then
    echo "check-no-global-cache: the patterns no longer catch $exception (the known bug); fix this script" >&2
    exit 1
fi
if ! grep -B1 -x 'mod mutation;' crates/vt-core/src/lib.rs | grep -q 'cfg(feature = "mutation-address-keyed-cache")'; then
    echo "check-no-global-cache: $exception must be compiled only under feature mutation-address-keyed-cache" >&2
    exit 1
fi

mapfile -t files < <(find crates -name '*.rs' -not -path '*/target/*' -not -path "$exception" | sort)
found="$(scan "${files[@]}")"
if [[ -n "$found" ]]; then
    echo "check-no-global-cache: process-wide state that could cache derived data (use a ResidentSlot):" >&2
    echo "$found" >&2
    exit 1
fi
echo "check-no-global-cache: ok (${#files[@]} files; exception $exception is feature-gated)"
