/* test_tok.c — tests of tok.c (filled in by its owner). */
#include "test.h"

void test_tok(void)
{
}
