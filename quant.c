/* quant.c */
#include "strata.h"
