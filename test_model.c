/* test_model.c — tests of model.c (filled in by its owner). */
#include "test.h"

void test_model(void)
{
}
