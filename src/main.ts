import 'reflect-metadata';
import { Logger } from '@nestjs/common';
import { ConfigError, loadConfig } from './config/app-config.js';
import { closeGracefully, createApp } from './app.factory.js';
import { StartupError } from './common/dependency-errors.js';

async function main(): Promise<void> {
  const config = loadConfig(process.env);
  const app = await createApp(config);
  try {
    await app.listen({ port: config.PORT, host: config.HOST });
  } catch (err) {
    await app.close().catch(() => undefined);
    // The port taken, a HOST that does not resolve or is not this machine's: one line, not a stack.
    throw new StartupError(`cannot listen on ${config.HOST}:${config.PORT}: ${(err as Error).message}`);
  }
  const log = new Logger('respool');
  // Graceful shutdown: stop accepting, let in-flight requests finish, stop the sweeper, close the pools.
  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    process.once(signal, () => {
      log.log(`${signal}: shutting down (answering what is in flight, at most SHUTDOWN_TIMEOUT_MS ${config.SHUTDOWN_TIMEOUT_MS} ms)`);
      setTimeout(() => {
        console.error(`respool: shutdown took longer than ${config.SHUTDOWN_TIMEOUT_MS} ms; exiting`);
        process.exit(1);
      }, config.SHUTDOWN_TIMEOUT_MS).unref();
      closeGracefully(app).then(
        () => {
          log.log('stopped');
          process.exit(0);
        },
        (err: unknown) => {
          console.error('respool: error during shutdown', err);
          process.exit(1);
        },
      );
    });
  }
  // Through the app's logger: a JSON line with its time, pid and host, like every other. The port listened on (PORT 0:
  // one the system chose).
  const address = app.getHttpServer().address();
  const port = typeof address === 'object' && address !== null ? address.port : config.PORT;
  log.log(`listening on http://${config.HOST}:${port} (docs at /docs)`);
}

main().catch((err: unknown) => {
  if (err instanceof ConfigError || err instanceof StartupError) {
    console.error(`respool cannot start: ${err.message}`);
  } else {
    // Not foreseen: its stack, for the bug report (not the whole object, which for a driver error is every field).
    console.error(`respool cannot start: ${err instanceof Error ? err.stack : String(err)}`);
  }
  process.exit(1);
});
