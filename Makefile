# dfl: one build for everything.
#   make            programs into build/bin/
#   make check      C unit tests and the bats suite (GPU tests skip without a GPU)
#   make install PREFIX=/usr/local
#   make CUDA=0     build without the CUDA backend even where nvcc is present
#   make SAN=1      build with ASan and UBSan and DFL_DEBUG checks (into build-san/)
#   make DEPS=0 ... skip the set-up below
#   make fuzz       libFuzzer harnesses (clang, ASan, UBSan; into build-fuzz/), each run for
#                   FUZZ_TIME seconds (default 60); FUZZ=frame,config picks some
SHELL := /bin/bash
.SUFFIXES:
.DELETE_ON_ERROR:

VERSION := 0.1.0
PREFIX ?= /usr/local
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
ifeq ($(origin CUDA),undefined)
  CUDA := $(if $(NVCC),1,0)
endif
SAN ?= 0

ifeq ($(SAN),1)
  B ?= build-san
  SANFLAGS := -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer -fno-sanitize-recover=all
  # debug-build checks (the bucket lanes' invariants)
  DEBUGDEFS := -DDFL_DEBUG
else
  B ?= build
  SANFLAGS :=
endif

CC ?= cc
OPT ?= -O2
CFLAGS ?= $(OPT) -g
WARN := -Wall -Wextra -Wshadow -Wno-unused-parameter -Wformat=2 -Wvla -Wno-format-truncation
CPPFLAGS := $(foreach d,base formats backends models train,-Ilib/$(d)) -I/usr/include/x86_64-linux-gnu -D_GNU_SOURCE -DDFL_VERSION='"$(VERSION)"' $(DEBUGDEFS)
ALLCFLAGS = -std=gnu11 $(CFLAGS) $(WARN) -fPIC -fopenmp -pthread $(SANFLAGS) -MMD -MP
LDLIBS := -lzstd -larchive -lxxhash -ljansson -lopenblas -lm
LDFLAGS_ALL = -fopenmp -pthread $(SANFLAGS) $(LDFLAGS)

# Fuzzing (tests/fuzz/): the harnesses and the library built with clang, libFuzzer, ASan and
# UBSan into build-fuzz/, always without CUDA. Taken before the CUDA settings below.
FB := build-fuzz
FUZZ_CC ?= clang
FUZZ_TIME ?= 60
FUZZ ?=
FUZZ_SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS := -std=gnu11 -O1 -g $(filter-out -Wno-format-truncation,$(WARN)) -Wno-format-nonliteral -Wno-pass-failed -fopenmp -pthread $(FUZZ_SANFLAGS) -MMD -MP
FUZZ_CPPFLAGS := $(CPPFLAGS)
FUZZ_LDLIBS := $(LDLIBS)
FUZZ_SRCS := $(sort $(wildcard tests/fuzz/fuzz-*.c))
FUZZERS := $(FUZZ_SRCS:tests/fuzz/%.c=$(FB)/%)

# `make demo` and `make check` do their own set-up on a fresh Debian/Ubuntu machine: before
# anything is built, .ci/install-deps --ensure installs the packages of its list that are missing
# (as root, or through sudo), saying which, or stops make with the apt-get command to run.
ifneq ($(filter demo check check-unit check-bats,$(MAKECMDGOALS)),)
  ifneq ($(DEPS),0)
    ifneq ($(shell .ci/install-deps --ensure >&2 && echo ok),ok)
      $(error missing build dependencies (above); or run make with DEPS=0 to skip this)
    endif
  endif
endif

LIB_DIRS := base formats backends models train
LIB_SRCS := $(sort $(foreach d,$(LIB_DIRS),$(wildcard lib/$(d)/*.c)))
CU_SRCS := $(sort $(wildcard kernels/*.cu))
BIN_SRCS := $(sort $(wildcard bin/*.c))
UNIT_SRCS := $(sort $(wildcard tests/unit/*.c))
GPU_SRCS := $(sort $(wildcard tests/gpu/*.c))
TOOL_SRCS := $(sort $(wildcard tests/tools/*.c))

ifeq ($(CUDA),1)
  CPPFLAGS += -DDFL_CUDA=1 -I$(CUDA_HOME)/include
  NVCCFLAGS ?= -O3 -arch=sm_90 -lineinfo
  NVCCALL = -std=c++17 $(NVCCFLAGS) $(foreach d,$(LIB_DIRS),-Ilib/$(d)) -I$(CUDA_HOME)/include -DDFL_CUDA=1 \
            -DDFL_CUDA_LIBDIR='"$(CUDA_HOME)/lib64"' \
            -Xcompiler -fPIC,-Wall,-Wno-unused-parameter -MMD -MP
  LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lnccl \
            -lcudart_static -ldl -lrt -lstdc++
  CU_OBJS := $(CU_SRCS:%.cu=$(B)/obj/%.o)
  # kernels/moe_wgmma.cu holds wgmma, which needs sm_90a: it is always built for sm_90a (its
  # -arch=sm_90 dropped; any other arch of NVCCFLAGS kept, where its kernel compiles to a trap),
  # so that a Hopper GPU, which moe.cu sends to it, always finds the sm_90a code
  comma := ,
  $(B)/obj/kernels/moe_wgmma.o: override NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode arch=compute_90a$(comma)code=sm_90a
  # kernels/attn_wgmma.cu likewise (attn.cu sends a Hopper GPU's d128 attention to it)
  $(B)/obj/kernels/attn_wgmma.o: override NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode arch=compute_90a$(comma)code=sm_90a
  # kernels/dflash_wgmma.cu likewise (dflash_attn.cu sends a Hopper GPU's d128 pass KV to it)
  $(B)/obj/kernels/dflash_wgmma.o: override NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode arch=compute_90a$(comma)code=sm_90a
  # kernels/gemm_tma.cu likewise (the TMA GEMM: wgmma, setmaxnreg, the tensor copies)
  $(B)/obj/kernels/gemm_tma.o: override NVCCFLAGS := $(filter-out -arch=sm_90,$(NVCCFLAGS)) -gencode arch=compute_90a$(comma)code=sm_90a
else
  CU_OBJS :=
endif

LIB_OBJS := $(LIB_SRCS:%.c=$(B)/obj/%.o)
PROGS := $(BIN_SRCS:bin/%.c=$(B)/bin/%)
UNITS := $(UNIT_SRCS:tests/unit/%.c=$(B)/tests/%)
GPUTESTS := $(GPU_SRCS:tests/gpu/%.c=$(B)/tests/%)
TOOLS := $(TOOL_SRCS:tests/tools/%.c=$(B)/tools/%)
# libdfl is one shared library (the CUDA kernels are large: linking them into every program
# would make each binary several megabytes); programs find it through $ORIGIN/../lib.
LIBDFL := $(B)/lib/libdfl.so
LINKDFL = -L$(B)/lib -ldfl -Wl,-rpath,'$$ORIGIN/../lib'

all: $(PROGS) $(UNITS) $(GPUTESTS) $(TOOLS)

$(B)/obj/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(ALLCFLAGS) -c $< -o $@

$(B)/obj/%.o: %.cu
	@mkdir -p $(@D)
	$(NVCC) $(NVCCALL) -c $< -o $@

$(LIBDFL): $(LIB_OBJS) $(CU_OBJS)
	@mkdir -p $(@D)
	$(CC) -shared $(LDFLAGS_ALL) -Wl,-soname,libdfl.so $^ $(LDLIBS) -o $@

$(B)/bin/%: $(B)/obj/bin/%.o $(LIBDFL)
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS_ALL) $< $(LINKDFL) $(LDLIBS) -o $@

$(B)/tests/%: $(B)/obj/tests/unit/%.o $(LIBDFL)
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS_ALL) $< $(LINKDFL) $(LDLIBS) -o $@

$(B)/tests/%: $(B)/obj/tests/gpu/%.o $(LIBDFL)
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS_ALL) $< $(LINKDFL) $(LDLIBS) -o $@

$(B)/tools/%: $(B)/obj/tests/tools/%.o $(LIBDFL)
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS_ALL) $< $(LINKDFL) $(LDLIBS) -o $@

# The library objects carry coverage instrumentation (fuzzer-no-link); the harnesses link
# libFuzzer's main. tests/fuzz/run-fuzz builds these only where clang has libFuzzer.
$(FB)/obj/%.o: %.c
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CPPFLAGS) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FB)/libdfl.a: $(LIB_SRCS:%.c=$(FB)/obj/%.o)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(FB)/fuzz-%: $(FB)/obj/tests/fuzz/fuzz-%.o $(FB)/libdfl.a
	$(FUZZ_CC) -fopenmp -pthread $(FUZZ_SANFLAGS) -fsanitize=fuzzer $< $(FB)/libdfl.a $(FUZZ_LDLIBS) -o $@

fuzz-build: $(FUZZERS)

# Where the shared reference outputs live (tests skip what needs them when absent).
DFL_ORACLE ?= $(abspath ../shared/oracle)
export DFL_ORACLE
export DFL_BIN := $(abspath $(B)/bin)
export DFL_TESTBIN := $(abspath $(B)/tests)
export DFL_TOOLS := $(abspath $(B)/tools)

check: all
	+@tests/run-checks $(B)

# A few seconds of each harness (tests/run-checks fuzz, also part of check); fuzz: FUZZ_TIME
# seconds each, new inputs kept in build-fuzz/corpus/, crashes in build-fuzz/crashes/.
check-fuzz:
	+@tests/run-checks $(B) fuzz

fuzz:
	+@FUZZ_TIME=$(FUZZ_TIME) FUZZ=$(FUZZ) tests/fuzz/run-fuzz run

check-unit: all
	@tests/run-checks $(B) unit

check-bats: all
	@tests/run-checks $(B) bats

check-gpu: all
	@tests/run-checks $(B) gpu

bench: all
	@bench/run-all $(B)

man:
	@for m in man/*.[157]; do mandoc -Tlint -Wwarning "$$m" || exit 1; done; echo "man pages: lint clean"

demo: all
	@examples/demo $(B)

# The pipelines (shell programs) go beside the programs, with dfl-sh-setup, the library they source.
PIPELINES := $(filter-out pipelines/dfl-sh-setup,$(wildcard pipelines/dfl-*))

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/share/man/man1 \
	  $(DESTDIR)$(PREFIX)/share/man/man5 $(DESTDIR)$(PREFIX)/share/man/man7
	install -m 755 $(PROGS) $(PIPELINES) $(DESTDIR)$(PREFIX)/bin/
	install -m 755 $(LIBDFL) $(DESTDIR)$(PREFIX)/lib/
	install -m 644 pipelines/dfl-sh-setup $(DESTDIR)$(PREFIX)/bin/
	$(if $(wildcard man/*.1),install -m 644 $(wildcard man/*.1) $(DESTDIR)$(PREFIX)/share/man/man1/)
	$(if $(wildcard man/*.5),install -m 644 $(wildcard man/*.5) $(DESTDIR)$(PREFIX)/share/man/man5/)
	$(if $(wildcard man/*.7),install -m 644 $(wildcard man/*.7) $(DESTDIR)$(PREFIX)/share/man/man7/)

clean:
	rm -rf build build-san build-fuzz

print-%:
	@echo '$($*)'

.PHONY: all check check-unit check-bats check-gpu check-fuzz fuzz fuzz-build bench man demo install clean
.SECONDARY:

-include $(shell find $(B)/obj -name '*.d' 2>/dev/null)
-include $(shell find $(FB)/obj -name '*.d' 2>/dev/null)
