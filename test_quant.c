/* test_quant.c — tests of quant.c (filled in by its owner). */
#include "test.h"

void test_quant(void)
{
}
