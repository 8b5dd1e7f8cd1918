/* test_sample.c — tests of sample.c (filled in by its owner). */
#include "test.h"

void test_sample(void)
{
}
