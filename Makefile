# vmsight — `make run` shows it at work, `make test` runs every test.
# Both start from a fresh Debian bookworm machine: they install what is missing first.

SHELL := /bin/bash
CARGO ?= $(shell command -v cargo || echo $(HOME)/.cargo/bin/cargo)
export PATH := $(HOME)/.cargo/bin:$(PATH)
VMSIGHT := target/release/vmsight
# Guest-booting tests are CPU-heavy under TCG on 2 cores; two at a time keeps both cores busy.
TEST_THREADS ?= 2

.PHONY: all setup build tools qemu11 image run test unit-test guest-test guest-test-qemu10 lint \
	bench clean

all: build

setup:
	bash scripts/setup-host.sh

build: setup
	$(CARGO) build --release --workspace

# Host tools Debian does not package (virtiofsd), built from crates.io into the cache.
tools: setup
	bash scripts/build-tools.sh

# QEMU 11.1 in a Debian trixie root (root needed to build it), for `vmsight run --qemu trixie`,
# the tests that run guests on it and the demo's last part (docs/platforms.md).
qemu11: setup
	bash scripts/build-qemu-trixie.sh

image: build tools
	$(VMSIGHT) image build

run: image qemu11
	bash scripts/demo.sh

unit-test: build
	$(CARGO) test --release --workspace --exclude vmsight-tests

guest-test: image qemu11
	$(CARGO) test --release -p vmsight-tests -- --test-threads=$(TEST_THREADS)

# The full suite runs on the default QEMU: 11.1 of the trixie root, which `make qemu11` builds
# (QEMU 10.0 has a TCG race that aborts QEMU or stalls a guest vCPU timer, docs/launcher.md).
# This subset runs again on the system QEMU 10.0 (plugin API v4), chosen to exercise every
# interface vmsight uses there once (docs/platforms.md): the plugin (interception against
# strace, the checksums behind the insights, the block hooks behind FoxyIdle), vhost-user
# blk/net/fs/vsock, memfd RAM, QMP, fw_cfg and the serial channels (foundation), and the write
# tap. The redirect, qemu and symbiotic test files pick their QEMU themselves.
QEMU10_FILES := --test interception --test foundation --test insights --test filestream \
	--test hylics --test network --test foxyidle
QEMU10_TESTS := trace_matches separate_runs workload_outputs process_details unmonitored_ \
	command_output arguments_reach two_vcpus stdin_is synced_data a_read_only guest_poweroff \
	a_guest_panic plugin_counts root_disk_writes sigterm_leaves sigkill_of two_vms several_disks \
	a_qemu_failure hints_change_exactly vmsight_events_equal the_share_holds a_vm_sees_only \
	the_host_sends transfers_both_ways attribution_matches
QEMU10_RUN = VMSIGHT_QEMU=system $(CARGO) test --release -p vmsight-tests --no-fail-fast \
	$(QEMU10_FILES) -- \
	--test-threads=$(TEST_THREADS) $(QEMU10_TESTS)
guest-test-qemu10: image qemu11
	$(QEMU10_RUN)

# Every step runs even after one fails, so the end always says which fuzzing seeds this run
# drew (docs/fuzzing.md) and how many guest runs the harness ran again (tests/src/lib.rs,
# `rerun_reason`); more than one rerun fails the suite. The cargo-fuzz crate is built (not
# run: libFuzzer runs need nightly) so its targets keep compiling. The benchmark tooling's own
# unit tests (bench/lib/test_*.py: results files, report tables and plots) run too.
test: image qemu11
	@rm -rf target/vmsight-test-reruns target/vmsight-fuzz-seeds; status=0; \
	$(CARGO) test --release --workspace --no-fail-fast -- --test-threads=$(TEST_THREADS) \
		|| status=1; \
	$(CARGO) build --release --manifest-path fuzz/Cargo.toml --bins || status=1; \
	python3 -m unittest discover -s bench/lib -p 'test_*.py' || status=1; \
	$(QEMU10_RUN) || status=1; \
	VMSIGHT_FSVIEW_IMAGE="$$($(VMSIGHT) image info --json | jq -r .dir)/rootfs.img" \
		$(CARGO) test --release -p vmsight-fsview --test real_images -- --ignored external_image \
		|| status=1; \
	VMSIGHT_TEST_KERNEL_DIR="$$($(VMSIGHT) image info --json | jq -r .dir)" \
		$(CARGO) test --release -p vmsight-introspect --lib -- --ignored real_kernel_profile \
		|| status=1; \
	cat target/vmsight-fuzz-seeds/*.txt || status=1; \
	bash scripts/test-reruns.sh target/vmsight-test-reruns || status=1; \
	exit $$status

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings

# Every benchmark of bench/benches.tsv, one after another (hours under TCG), each writing
# bench/results/NAME.json; then bench/report.py regenerates docs/benchmarks-generated.md and
# docs/plots/ from all results (bench/README.md). BENCH=NAME runs that one benchmark only,
# BENCH=list lists them. A failed benchmark does not stop the others, but fails the target.
bench: image
	@status=0; bash bench/run-all.sh $(BENCH) || status=$$?; \
	if [ "$(BENCH)" != list ]; then python3 bench/report.py || status=1; fi; \
	exit $$status

clean:
	$(CARGO) clean
