// A disk-tiered table's host map of cached rows (tables/row_cache.py),
// stepped by one call a step where numpy takes dozens: the same
// decisions as its numpy twin in kernels/admit_rows.py, bit for bit.
// Called through ctypes, which releases Python's GIL for the call, so the
// other tables' host work runs meanwhile.
//
// TpeAdmitRows: gives each of a step's distinct rows a slot (the policy:
// admit_rows.py's docstring).
// TpeMarkUpdated: the slots of cached rows an update writes, marked dirty,
// their rows' changed bits set.
//
// Both return 0, -1 having changed nothing (admission: too few free
// slots; marking: a row not cached), or -2 having changed nothing (a row
// outside [0, rows)).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

// counters[]: what the map counts besides its arrays.
enum Counter { kStep = 0, kHand, kCounted, kHits, kMisses };

}  // namespace

// The map: slot_of_row [rows] (slot + 1, 0: not cached), row_of_slot
// [size] (-1: empty), last_use [size] (the last step that asked for the
// slot's row), dirty [size] (changed since read), frequency [rows] (steps
// that asked for the row, saturating at 255), counters [5].
// The step: rows [n], distinct. The policy: window, min_window, aging.
// Out: slots [n]; chosen, old, write_back [need]: the slots given to the
// rows not cached (in their order), the rows those slots held (-1: none),
// 1 where that row changed since read; need_out [1].
extern "C" int TpeAdmitRows(int64_t table_rows, int64_t size,
                            int32_t* slot_of_row, int64_t* row_of_slot,
                            int64_t* last_use, uint8_t* dirty,
                            uint8_t* frequency, int64_t* counters, int64_t n,
                            const int64_t* rows, int64_t window,
                            int64_t min_window, int64_t aging, int64_t* slots,
                            int64_t* chosen, int64_t* old,
                            uint8_t* write_back, int64_t* need_out) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= table_rows) return -2;
  }
  const int64_t step = counters[kStep] + 1;
  int64_t need = 0;
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = static_cast<int64_t>(slot_of_row[rows[i]]) - 1;
    need += slots[i] < 0;
  }
  // The rows cached stay: their slots are in use from this step on (the
  // old uses kept, should the step be refused).
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, its last use)
  used.reserve(n - need);
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) {
      used.emplace_back(slots[i], last_use[slots[i]]);
      last_use[slots[i]] = step;
    }
  }
  int64_t hand = counters[kHand];
  if (need > 0) {
    // Idle slots (no row of this step or the one before) of the window
    // ahead of the hand, in its order; else of the whole cache.
    const int64_t span = std::min(size, std::max(min_window, window * need));
    std::vector<int64_t> idle;
    idle.reserve(span);
    for (int64_t j = 0; j < span; ++j) {
      const int64_t slot = (hand + j) % size;
      if (last_use[slot] < step - 1) idle.push_back(slot);
    }
    if (static_cast<int64_t>(idle.size()) < need) {
      idle.clear();
      for (int64_t slot = 0; slot < size; ++slot) {
        if (last_use[slot] < step - 1) idle.push_back(slot);
      }
    }
    if (static_cast<int64_t>(idle.size()) < need) {
      for (auto it = used.rbegin(); it != used.rend(); ++it) {
        last_use[it->first] = it->second;  // (the oldest value last)
      }
      return -1;
    }
    hand = (hand + span) % size;
    // The least asked rows leave first, then the least recently used
    // (empty slots before all): the `need` smallest scores, ties in the
    // idle order (numpy's stable argsort, its first `need`).
    std::vector<std::pair<int64_t, int64_t>> scored(idle.size());
    for (size_t k = 0; k < idle.size(); ++k) {
      const int64_t held = row_of_slot[idle[k]];
      const int64_t score =
          held >= 0 ? (static_cast<int64_t>(frequency[held]) << 40) |
                          last_use[idle[k]]
                    : -1;
      scored[k] = {score, static_cast<int64_t>(k)};
    }
    if (need < static_cast<int64_t>(scored.size())) {
      std::nth_element(scored.begin(), scored.begin() + (need - 1),
                       scored.end());
    }
    std::sort(scored.begin(), scored.begin() + need);
    for (int64_t k = 0; k < need; ++k) chosen[k] = idle[scored[k].second];
  }
  // Counts of the rows asked for (halved once they grew by aging x size).
  for (int64_t i = 0; i < n; ++i) {
    frequency[rows[i]] += frequency[rows[i]] < 255;
  }
  int64_t counted = counters[kCounted] + n;
  if (counted >= aging * size) {
    for (int64_t row = 0; row < table_rows; ++row) {
      if (frequency[row]) frequency[row] >>= 1;  // (zero pages untouched)
    }
    counted = 0;
  }
  // The rows not cached take the chosen slots; their old rows leave.
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) continue;
    const int64_t slot = chosen[k];
    const int64_t previous = row_of_slot[slot];
    old[k] = previous;
    write_back[k] = previous >= 0 && dirty[slot];
    if (previous >= 0) slot_of_row[previous] = 0;
    slot_of_row[rows[i]] = static_cast<int32_t>(slot + 1);
    row_of_slot[slot] = rows[i];
    last_use[slot] = step;
    dirty[slot] = 0;
    slots[i] = slot;
    ++k;
  }
  counters[kStep] = step;
  counters[kHand] = hand;
  counters[kCounted] = counted;
  counters[kHits] += n - need;
  counters[kMisses] += need;
  *need_out = need;
  return 0;
}

// rows [n] (repeats allowed): their slots into slots [n]; each slot marked
// dirty, each row's bit of changed [rows / 8] set.
extern "C" int TpeMarkUpdated(int64_t table_rows,
                              const int32_t* slot_of_row, uint8_t* dirty,
                              uint8_t* changed, int64_t n,
                              const int64_t* rows, int64_t* slots) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= table_rows) return -2;
    slots[i] = static_cast<int64_t>(slot_of_row[rows[i]]) - 1;
    if (slots[i] < 0) return -1;
  }
  for (int64_t i = 0; i < n; ++i) {
    dirty[slots[i]] = 1;
    changed[rows[i] >> 3] |= static_cast<uint8_t>(1u << (rows[i] & 7));
  }
  return 0;
}
