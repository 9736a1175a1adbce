# vmsight — `make run` shows it at work, `make test` runs every test.
# Both start from a fresh Debian bookworm machine: they install what is missing first.

SHELL := /bin/bash
CARGO ?= $(shell command -v cargo || echo $(HOME)/.cargo/bin/cargo)
export PATH := $(HOME)/.cargo/bin:$(PATH)
VMSIGHT := target/release/vmsight
# Guest-booting tests are CPU-heavy under TCG on 2 cores; two at a time keeps both cores busy.
TEST_THREADS ?= 2

.PHONY: all setup build tools qemu11 image run test unit-test guest-test guest-test-qemu11 lint \
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

# The subset that runs again on QEMU 11.1 (plugin API v7), chosen to exercise every interface
# vmsight uses there once (docs/platforms.md): the plugin (interception against strace, the
# checksums behind the insights, the block hooks behind FoxyIdle), vhost-user blk/net/fs/vsock,
# memfd RAM, QMP, fw_cfg and the serial channels (foundation), and the write tap. The redirect,
# qemu and symbiotic test files pick their QEMU themselves and run in every guest-test.
QEMU11_FILES := --test interception --test foundation --test insights --test filestream \
	--test hylics --test network --test foxyidle
QEMU11_TESTS := trace_matches separate_runs workload_outputs process_details unmonitored_ \
	command_output arguments_reach two_vcpus stdin_is synced_data a_read_only guest_poweroff \
	a_guest_panic plugin_counts root_disk_writes sigterm_leaves sigkill_of two_vms several_disks \
	a_qemu_failure hints_change_exactly vmsight_events_equal the_share_holds a_vm_sees_only \
	the_host_sends transfers_both_ways attribution_matches
QEMU11_RUN = VMSIGHT_QEMU=trixie $(CARGO) test --release -p vmsight-tests $(QEMU11_FILES) -- \
	--test-threads=$(TEST_THREADS) $(QEMU11_TESTS)
guest-test-qemu11: image qemu11
	$(QEMU11_RUN)

test: image qemu11
	$(CARGO) test --release --workspace -- --test-threads=$(TEST_THREADS)
	$(QEMU11_RUN)
	# The ignored-by-default checks that need the real guest: the crawler on its root disk, the
	# kernel profile generated from its kernel's System.map, BTF and config.
	VMSIGHT_FSVIEW_IMAGE="$$($(VMSIGHT) image info --json | jq -r .dir)/rootfs.img" \
		$(CARGO) test --release -p vmsight-fsview --test real_images -- --ignored external_image
	VMSIGHT_TEST_KERNEL_DIR="$$($(VMSIGHT) image info --json | jq -r .dir)" \
		$(CARGO) test --release -p vmsight-introspect --lib -- --ignored real_kernel_profile

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings

bench: image
	bash bench/run-all.sh

clean:
	$(CARGO) clean
