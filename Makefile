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
  CFLAGS += -march=native
  B := build
endif

LIB_SRC  := gguf.c quant.c quant_gemm.c tok.c pool.c model.c sample.c json.c synth.c kv.c attn.c chat.c sched.c http.c
TEST_SRC := test.c $(sort $(wildcard test_*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(B)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(B)/%.o)

# The command-line program (default target); relinked every time, so it
# always matches the PORTABLE setting of this call.
strata: $(LIB_OBJ) $(B)/strata.o
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# Build and run the test runner (the README's test command).
test: $(B)/test strata
	./$(B)/test

# The tests marked slow as well (whole-model checks that take minutes).
test-slow: $(B)/test strata
	STRATA_SLOW=1 ./$(B)/test

$(B)/test: $(LIB_OBJ) $(TEST_OBJ)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

$(B)/%.o: %.c | $(B)
	$(CC) $(CFLAGS) -c -o $@ $<

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
	rm -rf build build-portable strata

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

.PHONY: strata test test-slow fuzz clean help run
-include $(wildcard $(B)/*.d)
