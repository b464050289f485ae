# The README's two commands, `make demo` and `make test`, and the steps under them.
# Each installs what is missing first (scripts/setup.sh: apt and pip, idempotent).

BUILD_DIR ?= build
JOBS      ?= $(shell nproc)
PREFIX    ?= $(BUILD_DIR)/install
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE    ?= 5G

# The demo: 2-digit addition with a small minGPT, ZeRO stage 2 config, on the
# GPU when there is one and on the CPU otherwise.
DEMO_CONFIG ?= configs/mingpt_zero2.json
DEMO_FLAGS  ?= --n_layer 2 --n_head 4 --n_embd 128 --batch_size 64 --max_epochs 12

.PHONY: all setup configure build test demo install docs clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo

configure: setup $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The demo builds what it runs (mingpt and the libraries under it), not the tests.
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target mingpt
	$(BUILD_DIR)/bin/mingpt --config $(DEMO_CONFIG) $(DEMO_FLAGS) --summary-json $(BUILD_DIR)/demo-summary.json

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# The API reference (Doxygen over */include/zero/; not part of `make test`):
# $(BUILD_DIR)/docs/html/index.html. Any warning fails it.
docs:
	@bash scripts/docs.sh $(BUILD_DIR)/docs

clean:
	rm -rf $(BUILD_DIR)
