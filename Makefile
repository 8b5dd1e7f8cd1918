# Strata — GNU Make only. Objects go to build/ (build-portable/ for
# PORTABLE=1); `make help` lists the targets.

CC      ?= cc
CFLAGS  ?= -O2
# -ffp-contract=off: no fused multiply-adds the source did not write, so
# dequantisation and the reference numerics are bit-exact with any compiler.
CFLAGS  += -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -ffp-contract=off -MMD -MP
LDLIBS  += -lm -lpthread

# PORTABLE=1: scalar kernels only (no -march=native), for any x86-64/ARM box.
ifeq ($(PORTABLE),1)
  CFLAGS += -DSTRATA_PORTABLE
  B := build-portable
else ifneq ($(PORTABLE),)
  $(error PORTABLE must be 1 or unset, not '$(PORTABLE)')
else
  # MARCH=x86-64-v3 (say) for a binary that runs on another machine, such as
  # the GPU box of gpu-bench.sh, whose CPU lacks some of this one's AVX-512
  MARCH ?= native
  CFLAGS += -march=$(MARCH)
  B := build
endif
# TRACE=1 (CUDA): a measuring build whose decode kernels record the chain's
# timeline, written to $$STRATA_GPU_TRACE (gpu_compat.h, GPU_TRACE), in a
# build folder of its own
ifneq ($(TRACE),)
  B := $(B)-trace
endif

# GPU=cuda / GPU=hip (what `make cuda` / `make hip` set): the GPU backend's
# objects replace gpu_none.c, in a build folder of their own.
NVCC      ?= nvcc
HIPCC     ?= hipcc
CUDA_ARCH ?= 75 80 86 89 90
HIP_ARCH  ?= gfx1030 gfx90a
ifeq ($(GPU),cuda)
  B := $(B)-cuda
  CFLAGS += -DSTRATA_GPU
  # attn_hip.hip's kernels without matrix cores serve CUDA cards too
  GPU_OBJ := $(patsubst %,$(B)/%.o,gpu.cu gpu_mv.cu gpu_mma.cu gpu_gemm.cu attn_cuda.cu attn_hip.hip)
  # machine code for each CUDA_ARCH, and PTX of the newest for later cards;
  # the runtime linked statically, so the binary starts without a driver;
  # cuBLAS is opened at run time where present (gpu_gemm.cu), hence -ldl
  GPU_FLAGS := -O3 -std=c++17 $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
    -gencode arch=compute_$(lastword $(CUDA_ARCH)),code=compute_$(lastword $(CUDA_ARCH)) \
    -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings -D_GNU_SOURCE
  GPU_COMPILE = $(NVCC) $(GPU_FLAGS) -x cu -c -o $@ $<
  LINK := $(NVCC) -cudart static
  LINK_FLAGS := -O2
  LDLIBS += -ldl
else ifeq ($(GPU),hip)
  B := $(B)-hip
  CFLAGS += -DSTRATA_GPU
  GPU_OBJ := $(patsubst %,$(B)/%.o,gpu.cu gpu_mv.cu gpu_mma.cu gpu_gemm.cu attn_hip.hip)
  GPU_FLAGS := -O3 -std=c++17 $(foreach a,$(HIP_ARCH),--offload-arch=$(a)) -Wall -Wextra -Werror -D_GNU_SOURCE
  GPU_COMPILE = $(HIPCC) $(GPU_FLAGS) -x hip -c -o $@ $<
  LINK := $(HIPCC)
  # the targets named at the link too, or hipcc asks rocm_agent_enumerator
  # for the machine's GPU (a Python traceback where there is none)
  LINK_FLAGS := -O2 $(foreach a,$(HIP_ARCH),--offload-arch=$(a))
else ifeq ($(GPU),)
  GPU_OBJ := $(B)/gpu_none.o
  LINK := $(CC)
  LINK_FLAGS = $(CFLAGS)
else
  $(error GPU must be cuda, hip or unset, not '$(GPU)')
endif

ifneq ($(TRACE),)
  GPU_FLAGS += -DSTRATA_TRACE
endif

LIB_SRC  := gguf.c quant.c quant_gemm.c tok.c pool.c model.c sample.c json.c synth.c kv.c attn.c chat.c sched.c http.c
TEST_SRC := test.c $(sort $(wildcard test_*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(B)/%.o) $(GPU_OBJ)
TEST_OBJ := $(TEST_SRC:%.c=$(B)/%.o)

# The command-line program (default target); relinked every time, so it
# always matches the PORTABLE and GPU settings of this call.
strata: $(LIB_OBJ) $(B)/strata.o
	$(LINK) $(LINK_FLAGS) -o $@ $^ $(LDLIBS)

# Strata with the CUDA backend (nvcc; CUDA_ARCH="75 80 86 89 90" by default,
# CUDA_ARCH=90 for a quick build). `make test GPU=cuda` runs its tests.
cuda:
	$(MAKE) GPU=cuda strata

# Strata with the HIP backend for AMD GPUs (hipcc; HIP_ARCH="gfx1030 gfx90a"
# by default). `make test GPU=hip` runs its tests.
hip:
	$(MAKE) GPU=hip strata

# Build and run the test runner (the README's test command).
test: $(B)/test strata
	./$(B)/test

# The tests marked slow as well (whole-model checks that take minutes).
test-slow: $(B)/test strata
	STRATA_SLOW=1 ./$(B)/test

$(B)/test: $(LIB_OBJ) $(TEST_OBJ)
	$(LINK) $(LINK_FLAGS) -o $@ $^ $(LDLIBS)

$(B)/%.o: %.c | $(B)
	$(CC) $(CFLAGS) -c -o $@ $<

$(B)/%.cu.o: %.cu $(wildcard gpu*.h) strata.h | $(B)
	$(GPU_COMPILE)

$(B)/%.hip.o: %.hip $(wildcard gpu*.h) strata.h | $(B)
	$(GPU_COMPILE)

$(B):
	mkdir -p $@

FUZZ_SECONDS ?= 60
# Fuzz the GGUF reader and the JSON parser with libFuzzer (clang) for
# FUZZ_SECONDS (default 60), starting from the test files.
fuzz: | $(B)
	clang -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined \
	  -o $(B)/fuzz fuzz.c gguf.c json.c -lm
	mkdir -p $(B)/fuzz-corpus
	cp -n ../shared/testdata/quant/*.gguf demo/reference.json $(B)/fuzz-corpus/ 2>/dev/null || true
	./$(B)/fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=65536 $(B)/fuzz-corpus

# Remove every build output.
clean:
	rm -rf build build-portable build-cuda build-portable-cuda build-hip build-portable-hip build-trace-cuda \
	  build-portable-trace-cuda strata

# List the targets.
help:
	@awk '/^# /{c = c ? c " " substr($$0, 3) : substr($$0, 3); next} \
	  /^[a-z-]+:/{if (c) printf "  %-10s %s\n", substr($$1, 1, length($$1) - 1), c} {c = ""}' Makefile

DEMO_PROMPT := It was a cold morning in November, and

# Build Strata and generate a paragraph with the bundled demo model (demo/README.md).
run: strata
	@printf '%s' "$(DEMO_PROMPT)"
	@./strata generate -m demo/strata-demo-Q8_0.gguf -p "$(DEMO_PROMPT)" -n 200 --seed 2 \
	  2>build/run.log; rc=$$?; echo; cat build/run.log >&2; exit $$rc

.PHONY: strata cuda hip test test-slow fuzz clean help run
-include $(wildcard $(B)/*.d)
