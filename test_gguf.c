/* test_gguf.c — tests of gguf.c (filled in by its owner). */
#include "test.h"

void test_gguf(void)
{
}
