// The lifecycle every backend's trainer goes through, driven by core/runtime only:
// setup -> init -> train -> cleanup(on_error). cleanup always runs, also after a failure.
#pragma once

namespace primus {

class Trainer {
 public:
  virtual ~Trainer() = default;
  virtual void setup() = 0;  // output folders, logging, devices
  virtual void init() = 0;   // model, optimizer, data, checkpoint load
  virtual void train() = 0;  // the step loop
  virtual void cleanup(bool on_error) = 0;  // flush metrics, release resources
};

}  // namespace primus
