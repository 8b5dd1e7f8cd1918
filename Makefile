# Strata — GNU Make only. Builds go to build/; `make help` lists the targets.

CC      ?= cc
CFLAGS  ?= -O2
CFLAGS  += -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -MMD -MP
LDLIBS  += -lm -lpthread

# PORTABLE=1: scalar kernels only (no -march=native), for any x86-64/ARM box.
ifeq ($(PORTABLE),1)
  CFLAGS += -DSTRATA_PORTABLE
else ifneq ($(PORTABLE),)
  $(error PORTABLE must be 1 or unset, not '$(PORTABLE)')
else
  CFLAGS += -march=native
endif

LIB_SRC  := gguf.c quant.c tok.c pool.c model.c sample.c json.c synth.c
TEST_SRC := test.c $(sort $(wildcard test_*.c))
LIB_OBJ  := $(LIB_SRC:%.c=build/%.o)
TEST_OBJ := $(TEST_SRC:%.c=build/%.o)

# The command-line program (default target).
strata: $(LIB_OBJ) build/strata.o
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# Build and run the test runner (the README's test command).
test: build/test strata
	./build/test

# The tests marked slow as well (whole-model checks that take minutes).
test-slow: build/test strata
	STRATA_SLOW=1 ./build/test

build/test: $(LIB_OBJ) $(TEST_OBJ)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

build/%.o: %.c | build
	$(CC) $(CFLAGS) -c -o $@ $<

build:
	mkdir -p build

# Remove every build output.
clean:
	rm -rf build strata

# List the targets.
help:
	@grep -B1 -E '^[a-z-]+:' Makefile | grep -E '^#' | sed 's/^# //'

DEMO_PROMPT := It was a cold morning in November, and

# Build Strata and generate a paragraph with the bundled demo model (demo/README.md).
run: strata
	@printf '%s' "$(DEMO_PROMPT)"
	@./strata generate -m demo/strata-demo-Q8_0.gguf -p "$(DEMO_PROMPT)" -n 200 --seed 2 \
	  2>build/run.log; rc=$$?; echo; cat build/run.log >&2; exit $$rc

.PHONY: test test-slow clean help run
-include $(wildcard build/*.d)
